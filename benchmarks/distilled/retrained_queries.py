"""A scorer with its lookahead queries trained again (issue #74): n of them, on a corpus, for the prompts
`--lookahead-on` names, the student and its shares kept. What `kvcompile distill` would compile with those settings
(its `with_lookahead_queries`), without fitting the student again: on the scorer's own corpus and seed the queries
come out the same; and on corpora distill does not offer: `repeating`, the repeating documents alone
(`repeating_documents` of the Austen novels: one sentence said 10-60 times, then a paragraph).

    python -m benchmarks.distilled.retrained_queries --model gemma-3-270m --corpus repeating --queries 8 \
        --lookahead-on all --out <folder>/distilled_scorer.safetensors
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import kvruntime
from kvcompile.calibration.corpus import Corpus, load_corpus, repeating_documents
from kvcompile.calibration.job import CompileJob
from kvcompile.recipe import default_artifact
from kvcompile.recipes.distilled.distill import with_lookahead_queries
from kvcompile.recipes.distilled.settings import DistillSettings
from kvruntime.methods.distilled.oracle import LOOKAHEAD_ON

DEFAULTS = DistillSettings()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--scorer", default=None, help="the scorer to start from (default: the model's)")
    parser.add_argument("--queries", type=int, default=DEFAULTS.lookahead_queries)
    parser.add_argument("--corpus", default="austen-facts", help="a calibration corpus, or repeating")
    parser.add_argument("--lookahead-on", default="all", choices=LOOKAHEAD_ON)
    parser.add_argument(
        "--seed", type=int, default=DEFAULTS.seed, help="distill's --seed (the queries' contexts and start)"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model, tokenizer = kvruntime.load_model(args.model)
    shipped = kvruntime.read_artifact(args.scorer or default_artifact(args.model, "distilled_scorer"))
    corpus = (
        Corpus("repeating", repeating_documents(load_corpus("austen").documents))
        if args.corpus == "repeating"
        else load_corpus(args.corpus)
    )
    settings = DistillSettings(
        oracle=shipped.params["oracle"],
        seed=args.seed,
        lookahead_queries=args.queries,
        lookahead_on=args.lookahead_on,
    )
    retrained = with_lookahead_queries(shipped, CompileJob(model, tokenizer, Path(args.out)), corpus, settings)
    lookahead = {**retrained.params["lookahead"], "corpus": args.corpus}
    kvruntime.save_artifact(
        dataclasses.replace(retrained, params={**retrained.params, "lookahead": lookahead}), args.out
    )
    print(f"wrote {args.out}: {lookahead}")


if __name__ == "__main__":
    main()
