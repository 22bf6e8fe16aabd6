"""A probe of why the pass key in repeated filler is lost at 0.5 (`passkey_layers.md`): the shipped scorer with
layer 0's compiled share capped at `--cap` times the average at every ratio, the excess given to the other layers
in proportion to their shares. At 0.5 the shipped shares give layer 0 twice the average, the whole prompt.

    python -m benchmarks.distilled.layer0_cap --out DIR [--cap 1.0]
    python -m benchmarks.distilled.passkey_layers --scorer DIR/distilled_scorer.safetensors --out ...
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from kvruntime.artifact import read_artifact, save_artifact

SCORER = Path("artifacts/smollm2-135m-instruct/distilled_scorer.safetensors")


def capped_first_layer(shares: torch.Tensor, cap: float) -> torch.Tensor:
    """Shares [R, L] (rows summing to 1) with layer 0 at most `cap` / L, the excess spread over the other layers in
    proportion to their shares; rows still sum to 1."""
    layers = shares.shape[1]
    first = shares[:, :1].clamp(max=cap / layers)
    excess = shares[:, :1] - first
    others = shares[:, 1:] * (1 + excess / shares[:, 1:].sum(dim=1, keepdim=True))
    return torch.cat([first, others], dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder of the variant's artifact")
    parser.add_argument("--cap", type=float, default=1.0, help="layer 0's largest share, in times the average")
    args = parser.parse_args()
    base = read_artifact(SCORER)
    shares = capped_first_layer(base.tensors["layer_shares"].double(), args.cap).float()
    args.out.mkdir(parents=True, exist_ok=True)
    variant = dataclasses.replace(base, tensors={**base.tensors, "layer_shares": shares})
    print(save_artifact(variant, args.out / "distilled_scorer.safetensors"))


if __name__ == "__main__":
    main()
