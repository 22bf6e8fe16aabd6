"""Exact tabular CQL for one-step (bandit) data: the reference d3rlpy's DiscreteCQL is checked against.

Per state s, Q(s, .) minimises   alpha * sum_i [logsumexp_a Q(s, a) - Q(s, a_i)] + 0.5 * sum_i (Q(s, a_i) - r_i)^2
over the records i of that state (the CQL objective with every transition terminal). The objective is convex and
states do not interact, so all states are solved at once to optimality.
"""

from __future__ import annotations

import torch


def tabular_cql(
    states: torch.Tensor, actions: torch.Tensor, rewards: torch.Tensor, num_states: int, num_actions: int, alpha: float
) -> torch.Tensor:
    """Q [num_states, num_actions] minimising the CQL objective; states without records stay at 0."""
    q = torch.zeros(num_states, num_actions, dtype=torch.float64, requires_grad=True)
    rewards = rewards.double()
    optimiser = torch.optim.LBFGS(
        [q], max_iter=500, tolerance_grad=1e-12, tolerance_change=1e-14, line_search_fn="strong_wolfe"
    )

    def objective() -> torch.Tensor:
        optimiser.zero_grad()
        taken = q[states, actions]
        loss = alpha * (q[states].logsumexp(dim=1) - taken).sum() + 0.5 * ((taken - rewards) ** 2).sum()
        loss.backward()
        return loss

    optimiser.step(objective)
    return q.detach()
