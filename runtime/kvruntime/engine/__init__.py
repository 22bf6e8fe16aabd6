"""The compression engine: the KV cache compressed during or at the end of prefill.

`compress(model, method, ratio=...)` is a context manager. Inside it, the base model's forward is wrapped
(`session.py`): every forward pass that starts on an empty cache with more than one token is a prefill, which the
session drives (a batch's rows, `rows.py`, and a long prompt's chunks, `streaming.py`, one forward each), and the
hook of each attention layer whose cache grows takes the last `window` queries the model computed (captured where its
attention runs) and hands them, with the layer's keys and values, to the method, which keeps its statistics (for
most methods, token scores from window attention); when the whole model has run, the method selects what each
(layer, KV head) keeps and the cache is cut to it (`cut.py`). A method whose layer budgets are known in advance has
each layer cut right after its attention instead (one layer at a time holds its full cache), and with
`prefill_chunk_size` the prompt goes in chunks, every layer cut after each (the cache held never exceeds the budgets
plus one chunk in one layer). Decoding then runs unchanged on the smaller cache. Generated tokens keep their
original positions because transformers derives them from the attention mask, not from the (compressed) cache
length; the question mode passes them explicitly (`answering.py`).

A batch (left-padded, as transformers' generation pads) is prefilled row by row: each row's own tokens go through the
model alone and are compressed exactly as that prompt alone would be; the rows' caches are then stacked into one
rectangular cache (each layer as long as its longest row, the slots after a row's entries hidden from attention,
`keep_masks.py`), and decoding runs batched on it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence

from torch import nn

from ..artifacts.artifact import Artifact, load_artifact
from ..errors import KVRuntimeError
from ..methods import Method
from ..methods.resolved import ResolvedRequest, resolve_request
from ..plumbing.attention import per_layer_attention
from .answering import CompressedContext, generate_after_context, logits_after_context
from .session import CompressionSession
from .state import chunk_bounds

__all__ = [
    "CompressedContext",
    "CompressionSession",
    "chunk_bounds",
    "compress",
    "generate_after_context",
    "logits_after_context",
]


@contextlib.contextmanager
def compress(
    model: nn.Module,
    method: str | Method | ResolvedRequest | None = None,
    ratio: float | None = None,
    budget: int | None = None,
    memory: str = "padded",
    artifacts: Sequence[str | os.PathLike | Artifact] = (),
    force: bool = False,
    options: Mapping[str, object] = {},
    prefill_chunk_size: int | None = None,
    kv_bits: int | None = None,
) -> Iterator[CompressionSession]:
    """Compress the KV cache of every prefill run inside the block. A left-padded batch (with its attention mask)
    is compressed row by row, each row as it would be alone; `session.batch_report` reports it.

    method: a method name or instance, or a request resolved already (`resolve_request`: then `ratio` or `budget`
    picks one of its requests, and nothing else is given); None takes the method and ratio of a `tuned_defaults`
    artifact among `artifacts` (written by `kvcompile tune`), or `kvcompress` when there is none.
    ratio: fraction of cache entries removed, in [0, 1); budget: tokens kept per layer (give one of the two).
    memory: how per-head counts that differ inside a layer are stored: `padded` (default) gives every head of a
    layer the layer's largest count, filled with each head's next-best tokens; `masked` uses the same slots but
    hides the entries beyond each head's own count (the method's exact selection). Both free the same bytes.
    artifacts: compiled artifacts the method needs (`kvruntime.methods.required_artifact_kinds`): files, or bundles
    (a folder written by `kvcompile bundle`, or its hub repo id), or artifacts read already (`read_artifact`), checked
    against the model first (refused if compiled for another model).
    options: settings of a method given by name (compilerkv: `nearest_budget`, `uniform_heads`, `fixed_threshold`, `elastic`).
    prefill_chunk_size: feed a longer prompt in chunks of this many tokens, every layer cut to its budget after each
    (methods whose layer budgets are known in advance): the cache held never exceeds the budgets plus one chunk in
    one layer. Later chunks attend to what the earlier ones kept, so the answer may differ from a one-piece prefill.
    Such methods are cut layer by layer inside the prefill in any case (the same result as cutting at its end).
    kv_bits: quantize the kept entries for decoding, 8 (FP8, built in) or 4 (int4, needs optimum-quanto): the
    selection reads the prefill's full-precision keys; one prompt at a time (`quantized_cache`).
    """
    if isinstance(method, ResolvedRequest):
        if artifacts or options or memory != "padded" or prefill_chunk_size is not None or kv_bits is not None:
            raise KVRuntimeError(
                "a resolved request holds its artifacts, options, memory, chunk size and kv_bits: give only ratio or "
                "budget beside it"
            )
        resolved = method
    else:
        resolved = resolve_request(method, ratio, budget, memory, artifacts, options, prefill_chunk_size, kv_bits)
        ratio = budget = None
    for artifact in resolved.artifacts:  # read once per resolved request; checked against each model it meets
        load_artifact(artifact, model=model, force=force)
    session = CompressionSession(model, resolved, resolved.request(ratio, budget))
    with per_layer_attention(model), session.attached():
        yield session
