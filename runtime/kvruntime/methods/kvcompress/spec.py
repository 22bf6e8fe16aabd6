"""KV-Compress's registration (`kvruntime.registry`)."""

from ...registry import MethodSpec

SPEC = MethodSpec(
    name="kvcompress",
    summary="KV-Compress (KVC-w): squared window attention, one global pool over layers and KV heads",
    window=8,
    error_aware=True,
    streams=lambda options: False,  # the global pool compares every layer's scores
)
