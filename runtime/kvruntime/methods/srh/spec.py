"""CompressKV's Semantic Retrieval Heads' registration (`kvruntime.registry`); `compresskv` is srh with the
error-aware layer budgets."""

from ...registry import MethodSpec

SPEC = MethodSpec(
    name="srh",
    summary="CompressKV: its compiled retrieval heads choose the tokens (compresskv: with error-aware layer budgets)",
    window=8,
    needs="srh_heads",
    error_aware=True,
    aliases={"compresskv": "srh+error-aware"},
    compared=("compresskv",),
)
