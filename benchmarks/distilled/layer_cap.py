"""A probe of why the pass key in repeated filler is lost at 0.5 (`passkey_layers.md`): the shipped scorer with
the compiled shares of `--layers` capped at `--cap` times the average at every ratio, the excess given to the other
layers in proportion to their shares. At 0.5 the shipped shares give layer 0 twice the average, the whole prompt.

    python -m benchmarks.distilled.layer_cap --out DIR [--layers 0] [--cap 1.0]
    python -m benchmarks.distilled.passkey_layers --scorer DIR/distilled_scorer.safetensors --out ...
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from kvcompile.recipe import default_artifact
from kvruntime.artifacts.artifact import read_artifact, save_artifact

SCORER = default_artifact("default", "distilled_scorer")


def capped_layers(shares: torch.Tensor, capped: list[int], cap: float) -> torch.Tensor:
    """Shares [R, L] (rows summing to 1) with the `capped` layers at most `cap` / L, the excess spread over the other
    layers in proportion to their shares; rows still sum to 1."""
    chosen = torch.zeros(shares.shape[1], dtype=torch.bool)
    chosen[capped] = True
    kept = torch.where(chosen, shares.clamp(max=cap / shares.shape[1]), shares)
    excess = (shares - kept).sum(dim=1, keepdim=True)
    others = torch.where(chosen, torch.zeros_like(kept), kept)
    return torch.where(chosen, kept, kept * (1 + excess / others.sum(dim=1, keepdim=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder of the variant's artifact")
    parser.add_argument("--layers", default="0", help="the layers capped, comma-separated")
    parser.add_argument("--cap", type=float, default=1.0, help="their largest share, in times the average")
    args = parser.parse_args()
    base = read_artifact(SCORER)
    capped = [int(layer) for layer in args.layers.split(",")]
    shares = capped_layers(base.tensors["layer_shares"].double(), capped, args.cap).float()
    args.out.mkdir(parents=True, exist_ok=True)
    variant = dataclasses.replace(base, tensors={**base.tensors, "layer_shares": shares})
    print(save_artifact(variant, args.out / "distilled_scorer.safetensors"))


if __name__ == "__main__":
    main()
