"""The runtime's compression methods, one folder each (`<name>/spec.py` registers it, `<name>/method.py` is the
method; `kvruntime.registry` lists them), the interface they implement (`base.py`), `+error-aware`' error-aware layer
budgets (`layer_budgets.py`) and how a method is built from its name (`build.py`). Torch-free until a name is used:
the registrations under it load without torch."""

from __future__ import annotations

from ..lazy_exports import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        **dict.fromkeys(("LayerInputs", "Method", "PrefillResult", "ScoringMethod", "Selection"), "base"),
        "check_prefill_chunk_size": "base",
        **dict.fromkeys(("build_method", "get_method"), "build"),
        "WithLayerBudgets": "layer_budgets",
        "CompilerKV": "compilerkv.method",
        "Distilled": "distilled.method",
        "KVCompose": "kvcompose.method",
        "KVCompress": "kvcompress.method",
        "SemanticRetrievalHeads": "srh.method",
        "SnapKV": "snapkv.method",
    },
)
