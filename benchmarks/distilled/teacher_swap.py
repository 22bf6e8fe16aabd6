"""A copy of a distilled scorer that records another oracle (issue #74's comparison of teachers): with
`distilled:scores=oracle` the runtime replays the oracle a scorer records, so the copy replays that teacher under the
same selection rule (the scorer's layer shares and floor), without distilling a student of it. The student's weights
and queries are copied unchanged and are not read by `scores=oracle`.

    python -m benchmarks.distilled.teacher_swap --model gemma-3-270m \
        --scorer artifacts/gemma-3-270m/distilled_scorer.safetensors --oracle repeat --out <folder>/distilled_scorer.safetensors
"""

from __future__ import annotations

import argparse
import dataclasses

import kvruntime
from kvcompile.recipes.distilled.distill import oracle_prefix
from kvruntime.methods.distilled.oracle import ORACLES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="the model whose tokenizer encodes the oracle's prefix")
    parser.add_argument("--scorer", required=True)
    parser.add_argument("--oracle", required=True, choices=ORACLES)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    _, tokenizer = kvruntime.load_model(args.model)
    scorer = kvruntime.read_artifact(args.scorer)
    params = {**scorer.params, "oracle": args.oracle, "task_prefix": oracle_prefix(tokenizer, args.oracle)}
    kvruntime.save_artifact(dataclasses.replace(scorer, params=params), args.out)
    print(f"wrote {args.out}: oracle {args.oracle}, prefix of {len(params['task_prefix'])} tokens")


if __name__ == "__main__":
    main()
