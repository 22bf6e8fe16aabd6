"""Why `distilled` loses the pass key when it keeps more (issue #33): the eval's 18 held-out prompts (pass key,
needle, multi-key x 6 at 2,048 tokens, seed 0, question-agnostic), answered under variants of the selection rule,
with the share of the answer's tokens each keeps.

    python -m benchmarks.distilled.rule_probe [--ratios 0.5,0.75,0.9] [--betas 1,2] [--seed 0] [--variants TEXT]

Variants: the default (dynamic allocation), uniform and compiled layer splits, the teacher (`scores=oracle`, two
passes), and the compiled split over the student's scores mixed with a key-geometry term, Compactor's: the log of
each key's leverage score (its diagonal entry of the hat matrix of the layer's keys, per KV head), z-scored and
scaled by the student's own spread, `beta` times: distilled's `leverage` option since (`kvruntime/methods/distilled/
leverage.py`; this probe found it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
from pathlib import Path

import torch
from tqdm.auto import tqdm

import kvruntime
from benchmarks.coverage import answer_positions, coverage
from benchmarks.reporting import command_line, machine, markdown_table, write_results
from kvcompile.calibration.corpus import load_corpus
from kvcompile.evaluation.runner import split_prompt
from kvcompile.tasks.suite import suite_prompts
from kvruntime.cache_ops import attention_modules
from kvruntime.methods import Distilled
from kvruntime.methods.distilled import DistilledScorer, with_leverage

SCORER = Path("artifacts/smollm2-135m-instruct/distilled_scorer.safetensors")
TASKS = ("passkey", "needle", "multikey")


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


def variants(scorer: DistilledScorer, betas: list[float], model: torch.nn.Module) -> dict[str, kvruntime.Method]:
    attention = tuple(attention_modules(model))
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
    parser.add_argument("--variants", default="", help="run only the variants whose label contains this")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/distilled/rule_probe.md"))
    args = parser.parse_args()
    ratios = [float(x) for x in args.ratios.split(",")]
    model, tokenizer = kvruntime.load_model()
    scorer = DistilledScorer.from_artifact(kvruntime.load_artifact(SCORER, model=model))
    methods = {
        label: method
        for label, method in variants(scorer, [float(x) for x in args.betas.split(",")], model).items()
        if args.variants in label
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
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}  ",
        f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC. "
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
