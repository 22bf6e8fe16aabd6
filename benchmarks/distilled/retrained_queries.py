"""A scorer with its lookahead queries trained again (issue #74): n of them, on a corpus, for the prompts
`--lookahead-on` names, the student and its shares kept. What `kvcompile distill` would compile with those settings,
without fitting the student again (the same contexts, seed and steps: on the scorer's own corpus the queries come out
the same), and on corpora distill does not offer: `repeating`, the repeating documents alone
(`repeating_documents` of the Austen novels: one sentence said 10-60 times, then a paragraph).

    python -m benchmarks.distilled.retrained_queries --model gemma-3-270m --corpus repeating --queries 8 \
        --lookahead-on all --out <folder>/distilled_scorer.safetensors
"""

from __future__ import annotations

import argparse
import dataclasses

import kvruntime
from kvcompile.calibration.corpus import Corpus, load_corpus, repeating_documents
from kvcompile.recipe import default_artifact
from kvcompile.recipes.distilled.distill import prefill_features_and_targets
from kvcompile.recipes.distilled.lookahead import lookahead_contexts, train_lookahead_queries
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
        "--seed",
        type=int,
        default=DEFAULTS.seed + 1,
        help="the contexts' and the queries' start (distill's --seed + 1)",
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

    def prefill_and_oracle(ids):  # as `kvcompile distill` does
        cache, _, targets = prefill_features_and_targets(model, tokenizer, ids, shipped.params["oracle"])
        return cache, targets

    count, seed = DEFAULTS.lookahead_prompts, args.seed
    contexts = lookahead_contexts(
        model,
        tokenizer,
        corpus,
        prefill_and_oracle,
        count + DEFAULTS.lookahead_held_out,
        DEFAULTS.lookahead_tokens,
        seed,
    )
    queries, losses = train_lookahead_queries(
        model, contexts[:count], args.queries, DEFAULTS.lookahead_steps, seed, held_out=contexts[count:]
    )
    lookahead = {**shipped.params["lookahead"], "queries": args.queries, "corpus": args.corpus, **losses}
    params = {**shipped.params, "lookahead_on": args.lookahead_on, "lookahead": lookahead}
    tensors = {**shipped.tensors, "lookahead_queries": queries}
    kvruntime.save_artifact(dataclasses.replace(shipped, tensors=tensors, params=params), args.out)
    print(f"wrote {args.out}: {losses}")


if __name__ == "__main__":
    main()
