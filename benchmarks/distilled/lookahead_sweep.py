"""How many lookahead queries, trained on how many contexts: the KL to the oracle on calibration contexts never
trained on, per (queries, training contexts, steps), on one model (issue #74's "choose n by measurement"). The
contexts are prefilled once; every setting trains on the first k of them and is measured on the same held-out ones.

    python -m benchmarks.distilled.lookahead_sweep --model gemma-3-270m --queries 4,8,16,32 --prompts 12,24,48

What `kvcompile distill` trains (`kvcompile/recipes/distilled/lookahead.py`), with its corpus, oracle and seed; the
held-out KL is a screen for the eval, not a verdict: the eval's answer KL on held-out prompts decides.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import kvruntime
from benchmarks.reporting import markdown_table, run_header, write_results
from kvcompile.calibration.corpus import load_corpus
from kvcompile.recipes.distilled.distill import oracle_prefill
from kvcompile.recipes.distilled.lookahead import lookahead_contexts, train_lookahead_queries
from kvcompile.recipes.distilled.settings import DistillSettings

DEFAULTS = DistillSettings()


def integers(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--corpus", default="austen-facts")
    parser.add_argument("--oracle", default=DEFAULTS.oracle)
    parser.add_argument("--queries", type=integers, default=[4, 8, 16, 32])
    parser.add_argument("--prompts", type=integers, default=[12, 24, 48], help="training contexts")
    parser.add_argument("--steps", type=integers, default=[DEFAULTS.lookahead_steps])
    parser.add_argument("--held-out", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=DEFAULTS.lookahead_tokens)
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    started = time.time()
    model, tokenizer = kvruntime.load_model(args.model)
    most = max(args.prompts)
    prefill_and_oracle = oracle_prefill(model, tokenizer, args.oracle)  # as `kvcompile distill` does
    contexts = lookahead_contexts(
        model, tokenizer, load_corpus(args.corpus), prefill_and_oracle, most + args.held_out, args.tokens, args.seed + 1
    )
    held_out = contexts[most:]
    rows = []
    for queries in args.queries:
        for prompts in args.prompts:
            for steps in args.steps:
                began = time.time()
                _, losses = train_lookahead_queries(
                    model, contexts[:prompts], queries, steps, args.seed + 1, held_out=held_out
                )
                rows.append(
                    {
                        "queries": queries,
                        "training_contexts": prompts,
                        "steps": steps,
                        "kl_first_step": round(losses["kl_first_step"], 4),
                        "kl_last_tenth": round(losses["kl_last_tenth"], 4),
                        "kl_held_out": round(losses["kl_held_out"], 4),
                        "seconds": round(time.time() - began),
                    }
                )
    out = Path(args.out or f"benchmarks/distilled/lookahead_sweep_{args.model}.md")
    markdown = "\n".join(
        [
            f"# Lookahead queries: KL to the oracle on contexts never trained on, {args.model} (issue #74)",
            "",
            *run_header(),
            f"Ran for {time.time() - started:.0f} s. "
            f"Corpus `{args.corpus}`, oracle `{args.oracle}`, contexts of {args.tokens} tokens (seed "
            f"{args.seed + 1}, as `kvcompile distill`): each setting trained on the first `training_contexts`, "
            f"all measured on the same {args.held_out} after the {most} (`kl_held_out`; `kl_last_tenth`: on the "
            "training contexts over the last tenth of the steps).",
            "",
            *markdown_table(rows),
            "",
        ]
    )
    write_results(rows, out, markdown)


if __name__ == "__main__":
    main()
