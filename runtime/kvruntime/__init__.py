"""kvruntime: apply compiled KV-cache compression inside ordinary transformers generation.

    with kvruntime.compress(model, "kvcompress", ratio=0.5) as session:
        output = model.generate(input_ids, max_new_tokens=32)
    print(session.report)
"""

from .artifact import Artifact, load_artifact, read_artifact, save_artifact
from .engine import CompressedContext, CompressionSession, compress
from .errors import ArtifactError, KVRuntimeError, UnsupportedModelError
from .fingerprint import ModelFingerprint, model_fingerprint
from .methods import METHODS, KVCompress, Method, SnapKV, get_method
from .model_loading import DEFAULT_MODEL, load_model
from .report import CompressionReport

__all__ = [
    "DEFAULT_MODEL",
    "METHODS",
    "Artifact",
    "ArtifactError",
    "CompressedContext",
    "CompressionReport",
    "CompressionSession",
    "KVCompress",
    "KVRuntimeError",
    "Method",
    "ModelFingerprint",
    "SnapKV",
    "UnsupportedModelError",
    "compress",
    "get_method",
    "load_artifact",
    "load_model",
    "model_fingerprint",
    "read_artifact",
    "save_artifact",
]
