"""Why `distilled` loses the pass key when it keeps more (issue #33): the eval's 18 held-out prompts (pass key,
needle, multi-key x 6 at 2,048 tokens, seed 0, question-agnostic), answered under variants of the selection rule,
with the share of the answer's tokens each keeps.

    python -m benchmarks.distilled.rule_probe [--ratios 0.5,0.75,0.9] [--betas 1,2] [--seed 0] [--variants TEXT]

Variants: the default (dynamic allocation), uniform and compiled layer splits, the teacher (`scores=oracle`, two
passes), and the compiled split over the student's scores mixed with a key-geometry term, Compactor's: the log of
each key's leverage score (its diagonal entry of the hat matrix of the layer's keys, per KV head), z-scored and
scaled by the student's own spread, `beta` times: distilled's `leverage` option since (`kvruntime/methods/distilled/
leverage.py`; this probe found it). Then the levers measured against that default: the leverage of the keys before
RoPE (centred or not), the leverage at per-layer weights fitted against the teacher (`leverage_fit.py`), the layers'
pool with leverage, one pool over every (layer, KV head) (the DMS/KVzap threshold at equal bytes), and the compiled
shares with part of the budget pooled per prompt.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import statistics
from pathlib import Path

import torch
from tqdm.auto import tqdm

import kvruntime
from benchmarks.coverage import answer_positions, coverage
from benchmarks.distilled import leverage_fit
from benchmarks.reporting import markdown_table, run_header, write_results
from kvcompile.calibration.corpus import load_corpus
from kvcompile.evaluation.runner import split_prompt
from kvcompile.recipe import default_artifact
from kvcompile.tasks.suite import suite_prompts
from kvruntime.math.composite_tokens import composite_curve
from kvruntime.math.selection import global_head_counts, pooled_top_counts
from kvruntime.methods import Distilled
from kvruntime.methods.base import Selection
from kvruntime.methods.distilled import DistilledScorer, with_leverage
from kvruntime.models.layout import model_layout

SCORER = default_artifact("default", "distilled_scorer")
TASKS = ("passkey", "needle", "multikey")
FITTED = leverage_fit.OUT.with_suffix(".csv")


def keys_before_rope(attention: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """A layer's keys before RoPE [B, Hkv, N, D] from its attention input [B, N, hidden] (k_proj, and k_norm where
    the model has one)."""
    keys = attention.k_proj(hidden_states).view(*hidden_states.shape[:2], -1, attention.head_dim)
    if hasattr(attention, "k_norm"):
        keys = attention.k_norm(keys)
    return keys.transpose(1, 2)


@dataclasses.dataclass
class LeverageBeforeRope(Distilled):
    """The student's scores mixed with the leverage of the keys before RoPE, centred or not (Compactor's choice:
    RoPE turns the copies of a repeated text apart, so among post-RoPE keys a repeat is less redundant than it is),
    in place of the option's post-RoPE term (build it with leverage=0). The whole prompt at once (not streamed)."""

    beta: float = 2.0
    centred: bool = True
    attention: tuple = ()

    def stream_scores(self, layer, held, carry):
        scores, carry = super().stream_scores(layer, held, carry)
        keys = keys_before_rope(self.attention[layer.index], layer.hidden_states).float()
        if self.centred:
            keys = keys - keys.mean(dim=-2, keepdim=True)
        return with_leverage(scores, keys, self.beta, scores.shape[-1]), carry


@dataclasses.dataclass
class HeadPool(Distilled):
    """KVzap's and DMS's threshold across heads and layers at equal bytes: one pool over every (layer, KV head)'s
    scores, the per-prompt threshold that keeps the budget; the engine's `padded` memory then gives each layer its
    share of what its heads won (per-head slots free no bytes in a rectangular cache: a layer holds its largest
    head's count)."""

    def select(self, statistics, plan, prefill):
        return Selection(statistics, global_head_counts(statistics, plan.keep), ["per-head pool"])


@dataclasses.dataclass
class CompiledWithPool(Distilled):
    """The compiled layer shares for `1 - pooled` of the budget, the rest to the prompt's own global pool of
    composite tokens (layers the calibration prompts' average starves can take more on this prompt). Holds the whole
    prompt until its end, as the dynamic pool does."""

    pooled: float = 0.25

    @property
    def budgets_known_in_advance(self) -> bool:
        return False  # the pooled part waits for every layer's scores

    def select(self, statistics, plan, prefill):
        num_layers, (_, num_kv_heads, length) = len(statistics), statistics[0].shape
        compiled = torch.tensor(self.layer_budgets(num_layers, plan))
        reserved = (compiled * (1 - self.pooled)).floor().long().clamp_min(plan.window)
        curves = composite_curve(torch.stack([s[0] for s in statistics]))
        ranks = torch.arange(length)
        curves = torch.where(ranks[None, :] < reserved[:, None], torch.inf, curves)
        counts = pooled_top_counts(curves, int(compiled.sum()))
        return Selection(statistics, counts[:, None].expand(num_layers, num_kv_heads).clone(), ["compiled + pool"])


@dataclasses.dataclass
class FittedLeverage(Distilled):
    """The leverage term at per-layer weights fitted against the teacher (`leverage_fit.py`) in place of the option's
    one weight (build it with leverage=0)."""

    weights: tuple = ()

    def stream_scores(self, layer, held, carry):
        scores, carry = super().stream_scores(layer, held, carry)
        fresh = layer.hidden_states.shape[1]
        return with_leverage(scores, layer.keys, self.weights[layer.index], fresh), carry


def fitted_leverage_weights() -> tuple:
    """The per-layer weights `leverage_fit.py` wrote (empty before it ran)."""
    if not FITTED.exists():
        return ()
    with open(FITTED) as handle:
        return tuple(float(row[leverage_fit.WEIGHT]) for row in csv.DictReader(handle))


def variants(scorer: DistilledScorer, betas: list[float], model: torch.nn.Module) -> dict[str, kvruntime.Method]:
    attention = tuple(model_layout(model).cut_modules)
    # The rules as the probe measured them, before `leverage` existed (spelled out: the defaults have moved since).
    plain = dict(scorer=scorer, leverage=0.0)
    return {
        "distilled (dynamic)": Distilled(**plain, allocation="dynamic"),
        "allocation=uniform": Distilled(**plain, allocation="uniform"),
        "allocation=compiled": Distilled(**plain, allocation="compiled"),
        "teacher (scores=oracle)": Distilled(**plain, allocation="dynamic", scores="oracle"),
        **{
            f"compiled + leverage, beta {beta:g}": Distilled(scorer=scorer, allocation="compiled", leverage=beta)
            for beta in betas
        },
        **(
            {"compiled + fitted leverage": FittedLeverage(**plain, allocation="compiled", weights=fitted)}
            if (fitted := fitted_leverage_weights())
            else {}
        ),
        **{
            f"dynamic + leverage, beta {beta:g}": Distilled(scorer=scorer, allocation="dynamic", leverage=beta)
            for beta in betas
        },
        **{
            f"per-head pool + leverage, beta {beta:g}": HeadPool(scorer=scorer, allocation="dynamic", leverage=beta)
            for beta in betas
        },
        **{
            f"compiled {1 - pooled:g} + pool {pooled:g} + leverage, beta {beta:g}": CompiledWithPool(
                scorer=scorer, allocation="compiled", leverage=beta, pooled=pooled
            )
            for beta in betas
            for pooled in (0.25, 0.5)
        },
        **{
            f"compiled + leverage before RoPE{', centred' if centred else ''}, beta {beta:g}": LeverageBeforeRope(
                **plain, allocation="compiled", beta=beta, centred=centred, attention=attention
            )
            for beta in betas
            for centred in (True, False)
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ratios", default="0.5,0.75,0.9")
    parser.add_argument("--betas", default="1,2")
    parser.add_argument("--seed", type=int, default=0, help="the suite's seed (0: the eval's prompts)")
    parser.add_argument(
        "--variants", default="", help="run only the variants whose label contains this (or one of these, split by |)"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/distilled/rule_probe.md"))
    args = parser.parse_args()
    ratios = [float(x) for x in args.ratios.split(",")]
    model, tokenizer = kvruntime.load_model()
    scorer = DistilledScorer.from_artifact(kvruntime.load_artifact(SCORER, model=model))
    methods = {
        label: method
        for label, method in variants(scorer, [float(x) for x in args.betas.split(",")], model).items()
        if any(part in label for part in args.variants.split("|"))
    }
    prompts = suite_prompts(load_corpus("moby-dick"), tokenizer, TASKS, [2048], 6, args.seed, "auto")
    rows = []
    for index, prompt in enumerate(tqdm(prompts, desc="rule probe", unit="prompt")):
        context, question = split_prompt(tokenizer, prompt, question_aware=False)
        span = answer_positions(tokenizer, prompt.prompt[: prompt.question_start], prompt.expected[0])
        for ratio in ratios:
            for label, method in methods.items():
                with kvruntime.compress(model, method, ratio=ratio) as session:
                    answered = session.prefill(context).generate(
                        question, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.eos_token_id
                    )
                text = tokenizer.decode(answered[0, question.shape[1] :], skip_special_tokens=True)
                rows.append(
                    dict(
                        prompt=index,
                        task=prompt.task,
                        ratio=ratio,
                        method=label,
                        correct=int(prompt.score(text)),
                        coverage=round(coverage(session.kept_positions, span), 4),
                        answer=text.strip().replace("\n", " ").replace("|", "/")[:40],
                    )
                )
    write_results(rows, args.out, render(rows, ratios, list(methods)))


def render(rows: list[dict], ratios: list[float], methods: list[str]) -> str:
    table = []
    for label in methods:
        for ratio in ratios:
            cell = [r for r in rows if r["method"] == label and r["ratio"] == ratio]
            table.append(
                {
                    "method": label,
                    "ratio": ratio,
                    **{f"{t} answered": sum(r["correct"] for r in cell if r["task"] == t) for t in TASKS},
                    **{
                        f"{t} coverage": f"{statistics.mean(r['coverage'] for r in cell if r['task'] == t):.2f}"
                        for t in TASKS
                    },
                }
            )
    lines = [
        "# Distilled's selection rule on the eval's 18 held-out prompts: answers and answer-token coverage",
        "",
        *run_header(),
        f"{len({r['prompt'] for r in rows})} prompts, 6 per task (answered: of 6; at seed 0, the eval's prompts, the full "
        "cache answers 6 / 2 / 4), "
        "greedy, 16 new tokens. Coverage: kept answer tokens over answer tokens, mean over layers, KV heads and "
        "the task's prompts. Per prompt: the CSV beside this file.",
        "",
        *markdown_table(table),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
