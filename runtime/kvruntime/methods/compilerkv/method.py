"""CompilerKV (2026): stabilized utility, compiled head-reliability weights and a risk-adaptive threshold gate.

At the end of prefill every layer contributes its window attention (last 64 queries, averaged over heads, and per
query head) and its values' relative norms. With all layers in: alpha (the global attention mass) and rho make the
utility (the spec's, or the head-aware one the tables were learned on: `stabilized_utility`); the
compiled W_head weights max-pool it over query heads into one score per token and layer (one index set per layer,
shared by its KV heads); the prompt's entropy and window perplexity pick a threshold per layer from T_gate.

What the thresholds do (the window always stays):
- ratio-honest: the layers share exactly what was asked for (budget x layers entries); every token
  is ranked by its score over its layer's threshold, so the gate moves entries between layers and never changes
  the total;
- elastic (`elastic=True`, the paper's rule): a layer keeps the tokens scoring above its threshold, at most the
  budget, so a low-risk prompt keeps less than asked (the report says how much).
The rule is the one the tables were learned for (their `elastic` parameter; ratio-honest for tables that do
not record one); `elastic=` overrides it, and the report says when the two differ.
`uniform_heads` and `fixed_threshold` switch a table off (the paper's ablations).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...errors import KVRuntimeError
from ...registry import option_fields
from ...requests.request import KeepPlan, Request
from ..base import LayerInputs, Method, PrefillResult, Selection
from .operating_points import check_compilerkv_request
from .risk_gate import kept_counts, risk_bin
from .signals import LayerSignals, layer_scores, layer_signals, prompt_signals
from .spec import SPEC
from .tables import CompilerKVTables


# Its options (window 64; elastic None: the tables' own rule) are the registration's.
@dataclasses.dataclass
class CompilerKV(option_fields(SPEC), Method):
    name = "compilerkv"
    tables: CompilerKVTables | None = None

    def check_request(self, request: Request) -> None:  # a budget not compiled is refused unless nearest_budget
        check_compilerkv_request(self.tables.budgets, self.nearest_budget, request)

    def layer_statistics(self, layer: LayerInputs) -> LayerSignals:
        return layer_signals(layer.queries, layer.keys, layer.values, layer.logits)

    def select(self, statistics: list[LayerSignals], plan: KeepPlan, prefill: PrefillResult) -> Selection:
        try:
            logprobs = prefill.token_logprobs(self.window - 1)
        except ValueError as exc:
            raise KVRuntimeError(f"compilerkv needs token ids: {exc}") from None
        signals = prompt_signals(statistics, logprobs)
        tables = self.tables.for_layers(len(statistics))
        keep = plan.keep  # entries per layer asked for
        # A ratio runs the tables of the nearest compiled budget (a budget must be a compiled one, or allowed near).
        index = tables.budget_index(keep, self.nearest_budget or plan.request.ratio is not None)
        budget = tables.budgets[index]
        entropy_bin = risk_bin(signals.entropy, tables.entropy_edges)
        perplexity_bin = risk_bin(signals.perplexity, tables.perplexity_edges)
        num_kv_heads = signals.rho.shape[1]
        num_layers = len(statistics)
        scores, thresholds = [], []
        for layer in range(num_layers):
            weights = tables.head_reliability[index, layer]
            if self.uniform_heads:
                weights = torch.ones_like(weights)
            threshold = self.fixed_threshold
            if threshold is None:
                threshold = float(tables.risk_thresholds[index, layer, entropy_bin, perplexity_bin])
            scores.append(layer_scores(signals, layer, weights, tables.utility))
            thresholds.append(threshold)
        elastic = bool(tables.elastic) if self.elastic is None else self.elastic
        counts = kept_counts(scores, thresholds, keep, elastic)
        notes = [
            f"compilerkv          tables of compiled budget {budget}"
            + (f" (the nearest to the {keep} tokens per layer asked for)" if budget != keep else "")
            + f"; entropy {signals.entropy:.3f} (bin {entropy_bin}), "
            f"window perplexity {signals.perplexity:.2f} (bin {perplexity_bin}); thresholds "
            f"{min(thresholds):.3f}-{max(thresholds):.3f}; {tables.utility} utility"
            + ("; W_head = 1" if self.uniform_heads else ""),
        ]
        if tables.elastic is not None and tables.elastic != elastic:
            notes.append(
                f"rule                tables learned under the {_rule_name(tables.elastic)} rule, run under the "
                f"{_rule_name(elastic)} one (elastic={elastic})"
            )
        if elastic:
            notes.append(
                f"risk gate           elastic: keeps {sum(counts)} of the {keep * num_layers} entries asked for "
                f"({sum(counts) / (keep * num_layers):.1%}; only tokens scoring above their layer's threshold stay)"
            )
        else:
            notes.append(
                f"risk gate           the layers share the {keep * num_layers} entries asked for, ranked by score over "
                f"their layer's threshold: {min(counts)}-{max(counts)} per layer"
            )
        count_tensor = torch.tensor(counts, dtype=torch.long)[:, None].expand(-1, num_kv_heads).clone()
        return Selection([s[None, None].expand(1, num_kv_heads, -1) for s in scores], count_tensor, notes)


def build(compiled: Any, options: dict[str, object]) -> CompilerKV:
    return CompilerKV(tables=compiled, **options)


def _rule_name(elastic: bool) -> str:
    return "elastic" if elastic else "ratio-honest"
