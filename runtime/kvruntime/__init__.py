"""kvruntime: apply compiled KV-cache compression inside ordinary transformers generation.

    with kvruntime.compress(model, "kvcompress", ratio=0.5) as session:
        output = model.generate(input_ids, max_new_tokens=32)
    print(session.report)
"""

from .allocation import error_aware_budgets
from .artifact import Artifact, load_artifact, read_artifact, save_artifact
from .engine import CompressedContext, CompressionSession, compress
from .errors import ArtifactError, KVRuntimeError, UnsupportedModelError
from .fingerprint import ModelFingerprint, model_fingerprint
from .compilerkv_tables import CompilerKVTables
from .kvcompose_stats import KVComposeStats
from .methods import (
    METHOD_NAMES,
    CompilerKV,
    KVCompose,
    KVCompress,
    Method,
    SemanticRetrievalHeads,
    SnapKV,
    WithLayerBudgets,
    get_method,
    required_artifact_kinds,
)
from .model_loading import DEFAULT_MODEL, load_model
from .report import CompressionReport
from .tuned_defaults import TunedDefaults

__all__ = [
    "DEFAULT_MODEL",
    "METHOD_NAMES",
    "Artifact",
    "ArtifactError",
    "CompilerKV",
    "CompilerKVTables",
    "CompressedContext",
    "CompressionReport",
    "CompressionSession",
    "KVCompose",
    "KVComposeStats",
    "KVCompress",
    "KVRuntimeError",
    "Method",
    "ModelFingerprint",
    "SemanticRetrievalHeads",
    "SnapKV",
    "TunedDefaults",
    "WithLayerBudgets",
    "UnsupportedModelError",
    "compress",
    "error_aware_budgets",
    "get_method",
    "load_artifact",
    "load_model",
    "model_fingerprint",
    "read_artifact",
    "required_artifact_kinds",
    "save_artifact",
]
