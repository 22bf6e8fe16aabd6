"""SnapKV's registration (`kvruntime.registry`)."""

from ...registry import MethodSpec

SPEC = MethodSpec(
    name="snapkv",
    summary="SnapKV: each KV head keeps its best pooled window attention, the same count in every layer",
    window=32,
    error_aware=True,
)
