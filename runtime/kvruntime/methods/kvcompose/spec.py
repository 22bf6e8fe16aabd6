"""KVCompose's registration (`kvruntime.registry`)."""

from ...registry import MethodSpec, Option


def _compiled(options) -> bool:
    return options.get("mode", "compiled") == "compiled"


SPEC = MethodSpec(
    name="kvcompose",
    summary="KVCompose: composite tokens, each layer's share from compiled attention statistics",
    window=32,
    needs="kvcompose_stats",
    needs_artifact=_compiled,
    options={
        "mode": Option(("compiled", "dynamic"), "compiled", "dynamic: the paper's two-pass scoring on the prompt"),
        "unstructured": Option(bool, False, "per-(layer, KV head) counts (appendix A), in masked memory"),
    },
    streams=lambda options: _compiled(options) and not options.get("unstructured", False),
    memory=lambda options: "masked" if options.get("unstructured", False) else None,
    operating_points=True,
)
