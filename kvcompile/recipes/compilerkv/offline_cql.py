"""Learning a decision table from bandit experience with d3rlpy's DiscreteCQL (horizon 1: every transition is
terminal, so the target is the reward itself and the loss is CQL's conservative term plus the squared error).

Only the greedy table is read out of the Q-function; the d3rlpy model itself is never saved (that would pickle).
Rewards are divided by their standard deviation before fitting: the argmax is unchanged by a positive scale, but
CQL's conservative term is O(alpha) whatever the rewards, so NLL differences of a few thousandths would otherwise
be drowned by it and the table would follow which actions happened to be sampled most.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import warnings

import numpy as np
import torch

from kvcompile.recipes.compilerkv.settings import CQLSettings
from kvruntime import KVRuntimeError


@dataclasses.dataclass
class GreedyTable:
    actions: np.ndarray  # [states] greedy action index per queried state
    learning_curve: list[float]  # CQL loss per epoch
    reward_scale: float


def _d3rlpy():
    # gym (a d3rlpy dependency) announces its own deprecation on import; it is not ours to show.
    with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import d3rlpy
    return d3rlpy


def fit_greedy_table(
    observations: np.ndarray,
    actions: np.ndarray,
    rewards: np.ndarray,
    num_actions: int,
    states: np.ndarray,
    settings: CQLSettings,
) -> GreedyTable:
    """Fit DiscreteCQL on one-step episodes and return the greedy action of each row of `states`."""
    d3rlpy = _d3rlpy()
    if len(rewards) == 0:
        raise KVRuntimeError("no experience to learn from")
    if not np.isfinite(rewards).all():
        raise KVRuntimeError(
            f"{int((~np.isfinite(rewards)).sum())} rewards are NaN or infinite: refusing to learn from them"
        )
    scale = float(rewards.std()) or 1.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small networks: one thread is faster than two, and deterministic
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # d3rlpy logs the dataset and every epoch to stdout
            dataset = d3rlpy.dataset.MDPDataset(
                observations=observations.astype(np.float32),
                actions=actions.astype(np.int64),
                rewards=(rewards / scale).astype(np.float32),
                terminals=np.ones(len(rewards), dtype=np.float32),
                action_space=d3rlpy.constants.ActionSpace.DISCRETE,
                action_size=num_actions,
            )
            d3rlpy.seed(settings.seed)
            algo = d3rlpy.algos.DiscreteCQLConfig(
                alpha=settings.alpha,
                learning_rate=settings.learning_rate,
                batch_size=min(settings.batch_size, len(rewards)),
                optim_factory=d3rlpy.optimizers.AdamWFactory(
                    weight_decay=settings.weight_decay,
                    lr_scheduler_factory=d3rlpy.optimizers.CosineAnnealingLRFactory(T_max=settings.steps),
                ),
            ).create(device="cpu:0")
            history = algo.fit(
                dataset,
                n_steps=settings.steps,
                n_steps_per_epoch=max(1, settings.steps // settings.epochs),
                show_progress=False,
                logger_adapter=d3rlpy.logging.NoopAdapterFactory(),
            )
            greedy = algo.predict(states.astype(np.float32))
    finally:
        torch.set_num_threads(threads)
    return GreedyTable(actions=np.asarray(greedy), learning_curve=[m["loss"] for _, m in history], reward_scale=scale)


def one_hot(index: np.ndarray, size: int) -> np.ndarray:
    return np.eye(size, dtype=np.float32)[index]


def ordinal(index: np.ndarray, size: int) -> np.ndarray:
    """Ordered categories as one coordinate in [0, 1]: neighbours are close, so they share what the data says."""
    return (index / max(1, size - 1))[:, None].astype(np.float32)


def head_state_features(
    budget: np.ndarray, layer: np.ndarray, head: np.ndarray, sizes: tuple[int, int, int]
) -> np.ndarray:
    """(budget, layer, query head): the budget as an ordinal coordinate (neighbouring budgets share their
    experience), layer and head one-hot (the network can share what layers and heads have in common where a single
    state has little data), and the (layer, head) pair one-hot: a head's reliability is its own, and with the layer
    and head codes alone the fit came out nearly additive (whole layers raised, which weights relative to the
    layer's largest turn into no change)."""
    return np.concatenate(
        [
            ordinal(budget, sizes[0]),
            one_hot(layer, sizes[1]),
            one_hot(head, sizes[2]),
            one_hot(layer * sizes[2] + head, sizes[1] * sizes[2]),
        ],
        axis=1,
    )


def gate_state_features(
    budget: np.ndarray,
    layer: np.ndarray,
    entropy_bin: np.ndarray,
    perplexity_bin: np.ndarray,
    sizes: tuple[int, int, int, int],
) -> np.ndarray:
    """(budget, layer, entropy bin, perplexity bin): the layer one-hot, the budget and the two risk bins as ordinal
    coordinates: they are ordered, and a cell without its own prompts is read between its neighbours rather than
    from untrained weights."""
    return np.concatenate(
        [
            ordinal(budget, sizes[0]),
            one_hot(layer, sizes[1]),
            ordinal(entropy_bin, sizes[2]),
            ordinal(perplexity_bin, sizes[3]),
        ],
        axis=1,
    )
