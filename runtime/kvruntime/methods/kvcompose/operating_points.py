"""KVCompose's compiled operating points, checked without torch: its layer shares are compiled per ratio."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

from ...artifacts.artifact_header import small_tensor_values
from ...errors import KVRuntimeError
from ...requests.request import Request
from ...requests.serving import compiled_ratios


def check_compiled_ratio(ratios: Sequence[float], ratio: float) -> None:
    low, high = ratios[0], ratios[-1]
    if not low - 1e-9 <= ratio <= high + 1e-9:
        raise KVRuntimeError(
            f"ratio {ratio:g} is outside the compiled ratios of the kvcompose stats ({low:g} to {high:g}; between "
            "them shares are interpolated): compile it with `kvcompile stats --ratios ...`, or use mode='dynamic'"
        )


def operating_points(artifact: str | os.PathLike, options: Mapping[str, object]) -> Callable[[Request], None]:
    """The check of a request's ratio against the ratios compiled into the stats at `artifact` (read once)."""
    ratios = compiled_ratios(small_tensor_values(artifact, "ratios"))
    return lambda request: check_compiled_ratio(ratios, request.ratio) if request.ratio else None
