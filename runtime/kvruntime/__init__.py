"""kvruntime: apply compiled KV-cache compression inside ordinary transformers generation.

    with kvruntime.compress(model, "kvcompress", ratio=0.5) as session:
        output = model.generate(input_ids, max_new_tokens=32)
    print(session.report)

This package's names are its API for applications: compressing (`compress`, the report), loading the model,
methods and requests, artifacts, errors. Everything else (the methods' math, the registry, the torch-free checks the
command line makes, what the compile stage shares with the runtime) is imported by its module path
(`kvruntime.registry`, `kvruntime.math.composite_tokens`, ...). Names are imported on first use
(PEP 562), so that `from kvruntime import KVRuntimeError` does not import torch and transformers.
"""

from __future__ import annotations

from .lazy_exports import lazy_exports

# public name -> the module that defines it
_EXPORTS = {
    # Applying compression.
    **dict.fromkeys(
        ("CompressedContext", "CompressionSession", "compress", "generate_after_context", "logits_after_context"),
        "engine",
    ),
    # A compressed context saved to a file, answered from in another process.
    **dict.fromkeys(("load_context", "save_context"), "engine.saved_context"),
    **dict.fromkeys(("BatchReport", "CompressionReport"), "report"),
    "DEFAULT_MODEL": "models.default_model",
    "load_model": "models.model_loading",
    # Methods and requests.
    "METHOD_NAMES": "registry",
    "Request": "requests.request",
    **dict.fromkeys(("ResolvedRequest", "resolve_request"), "methods.resolved"),
    **dict.fromkeys(("Method", "get_method"), "methods"),
    # Artifacts.
    **dict.fromkeys(("Artifact", "load_artifact", "read_artifact", "save_artifact"), "artifacts.artifact"),
    "ARTIFACT_KINDS": "artifacts.artifact_kinds",
    "model_fingerprint": "artifacts.fingerprint",
    # Errors.
    **dict.fromkeys(("ArtifactError", "KVRuntimeError", "UnsupportedModelError"), "errors"),
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
