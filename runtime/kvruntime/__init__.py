"""kvruntime: apply compiled KV-cache compression inside ordinary transformers generation.

    with kvruntime.compress(model, "kvcompress", ratio=0.5) as session:
        output = model.generate(input_ids, max_new_tokens=32)
    print(session.report)

The public names are imported on first use (PEP 562), so that `import kvruntime.errors` (what the command line needs
to parse its arguments and refuse bad ones) does not import torch and transformers.
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    "error_aware_budgets": "allocation",
    **dict.fromkeys(("Artifact", "load_artifact", "read_artifact", "save_artifact"), "artifact"),
    **dict.fromkeys(("CompressedContext", "CompressionSession", "compress"), "engine"),
    **dict.fromkeys(("ArtifactError", "KVRuntimeError", "UnsupportedModelError"), "errors"),
    **dict.fromkeys(("ModelFingerprint", "model_fingerprint"), "fingerprint"),
    "CompilerKVTables": "compilerkv_tables",
    "KVComposeStats": "kvcompose_stats",
    **dict.fromkeys(
        (
            "METHOD_NAMES", "CompilerKV", "KVCompose", "KVCompress", "Method", "SemanticRetrievalHeads", "SnapKV",
            "WithLayerBudgets", "get_method", "required_artifact_kinds",
        ),
        "methods",
    ),
    "DEFAULT_MODEL": "default_model",
    "load_model": "model_loading",
    "CompressionReport": "report",
    "TunedDefaults": "tuned_defaults",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvruntime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
