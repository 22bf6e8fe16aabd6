"""The KVzap peer on distill's own calibration sums: from the partial statistics of one `kvcompile distill --oracle
kvzip_plus --shard i/n` compile, both students at once (the sums of a compile hold every feature; a student is
chosen when they are finished), so that the peer reads exactly the text, the oracle and the tokens ours does.

    python -m benchmarks.distilled.kvzap_peer PARTIAL [PARTIAL ...] --scorer OUT.safetensors --kvzap-out DIR

Writes the distilled scorer (`--student all`, what `kvcompile merge` would write) and KVzap's linear student
(`--student hidden`: the attention input and a bias, what `kvcompile distill --student hidden` would write from the
same sums) exported as a KVzap checkpoint (`kvcompile export-kvzap`) for `kvcompile eval --methods kvpress-kvzap`.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from kvcompile.calibration.partial_statistics import merge_partials
from kvcompile.recipes.distilled.distill import finish_distilled_scorer
from kvcompile.recipes.distilled.kvzap_checkpoint import write_kvzap_checkpoint
from kvruntime import read_artifact, save_artifact


def finished(partials: list, student: str):
    def finish(sums, run):
        return finish_distilled_scorer(sums, dataclasses.replace(run, settings={**run.settings, "student": student}))

    return merge_partials(partials, {"distilled_scorer": finish})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("partials", nargs="+", type=Path)
    parser.add_argument("--scorer", type=Path, required=True)
    parser.add_argument("--kvzap-out", type=Path, required=True)
    args = parser.parse_args()
    partials = [read_artifact(path) for path in args.partials]
    save_artifact(finished(partials, "all"), args.scorer)
    write_kvzap_checkpoint(finished(partials, "hidden"), args.kvzap_out)
    print(f"wrote {args.scorer} and {args.kvzap_out}")


if __name__ == "__main__":
    main()
