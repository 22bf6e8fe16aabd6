"""kvruntime: apply compiled KV-cache compression inside ordinary transformers generation.

    with kvruntime.compress(model, "kvcompress", ratio=0.5) as session:
        output = model.generate(input_ids, max_new_tokens=32)
    print(session.report)

This package's names are its API, for applications and for the compile stage (`kvcompile` imports nothing else
from it). They are imported on first use (PEP 562), so that `from kvruntime import KVRuntimeError` (what the command
line needs to parse its arguments and refuse bad ones) does not import torch and transformers.
"""

from __future__ import annotations

from .lazy_exports import lazy_exports

# public name -> the module that defines it
_EXPORTS = {
    # Applying compression.
    **dict.fromkeys(("CompressedContext", "CompressionSession", "compress", "generate_after_context"), "engine"),
    **dict.fromkeys(
        (
            "CompilerKV",
            "Distilled",
            "KVCompose",
            "KVCompress",
            "LayerPrefill",
            "Method",
            "Prefill",
            "ScoringMethod",
            "SemanticRetrievalHeads",
            "Selection",
            "SnapKV",
            "WithLayerBudgets",
            "check_method_serves",
            "get_method",
        ),
        "methods",
    ),
    "CompressionReport": "report",
    "DEFAULT_MODEL": "default_model",
    "load_model": "model_loading",
    "per_layer_attention": "attention",
    "KEEP_MASK_KEYWORD": "attention",
    # Artifacts: the format, every kind's schema and command, and what the runtime reads them into.
    **dict.fromkeys(
        (
            "Artifact",
            "check_tensors",
            "load_artifact",
            "read_artifact",
            "save_artifact",
            "tensors_checksum",
            "write_safetensors_atomically",
        ),
        "artifact",
    ),
    **dict.fromkeys(("ARTIFACT_KINDS", "ArtifactKind", "artifact_kind"), "artifact_kinds"),
    **dict.fromkeys(("ModelFingerprint", "model_fingerprint"), "fingerprint"),
    "CompilerKVTables": "methods.compilerkv",
    "KVComposeStats": "methods.kvcompose",
    "DistilledScorer": "methods.distilled",
    "TunedDefaults": "tuned_defaults",
    # Requests and errors, torch-free: the command line checks its input with them before importing torch.
    **dict.fromkeys(
        (
            "MEMORY_MODES",
            "Request",
            "check_method_options",
            "check_request",
            "kept_per_head",
            "parse_option_pairs",
            "required_artifact_kinds",
        ),
        "request",
    ),
    **dict.fromkeys(("ArtifactError", "KVRuntimeError", "UnsupportedModelError", "first_line"), "errors"),
    **dict.fromkeys(
        ("cache_root", "check_output_file", "check_output_folder", "path_lock", "write_atomically"), "files"
    ),
    # Torch-free checks of what a command asks for: an artifact's header, the model's positions, what a method serves.
    **dict.fromkeys(("check_artifact_file", "header_kind", "header_params", "read_header"), "artifact_header"),
    **dict.fromkeys(("check_model_spec", "check_positions", "position_limit"), "model_spec"),
    **dict.fromkeys(("UTILITIES", "MethodFacts", "check_serves", "method_facts"), "serving"),
    **dict.fromkeys(
        ("COMPARED_NAMES", "METHOD_NAMES", "METHODS", "MethodSpec", "method_spec", "methods_help", "methods_table"),
        "registry",
    ),
    # What the compile stage measures exactly as the runtime applies it (the same functions, not copies).
    # cache_argument, hooked_cache, output_cache: the cache under either name transformers gives it.
    **dict.fromkeys(
        ("attention_modules", "cache_argument", "cache_bytes", "hooked_cache", "output_cache"), "cache_ops"
    ),
    **dict.fromkeys(("error_aware_budgets",), "allocation"),
    **dict.fromkeys(("top_indices",), "selection"),
    **dict.fromkeys(("query_hooks", "window_attention"), "window"),
    "task_attention_maxima": "second_pass",
    **dict.fromkeys(
        ("LayerSignals", "PromptSignals", "layer_scores", "layer_signals", "prompt_signals"),
        "methods.compilerkv",
    ),
    **dict.fromkeys(("candidate_count", "kept_counts", "quantile_edges", "risk_bin"), "methods.compilerkv.risk_gate"),
    **dict.fromkeys(("feature_count", "oracle_targets", "predicted_scores", "token_features"), "methods.distilled"),
    **dict.fromkeys(
        ("composite_curve", "kv_head_scores", "prompt_allocation", "rank_quantile_values", "sorted_head_scores"),
        "methods.kvcompose.composite_tokens",
    ),
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
