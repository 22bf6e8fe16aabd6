"""The compression engine: hooks that compress the KV cache once, at the end of prefill.

`compress(model, method, ratio=...)` is a context manager. Inside it, every forward pass that starts on an empty
cache with more than one token is a prefill: each attention layer's hook rebuilds the last `window` queries and hands
them, with the layer's keys and values, to the method, which keeps its statistics (for most methods, token scores
from window attention); when the whole model has run, the method selects what each (layer, KV head) keeps and the
cache is cut to it. Decoding then runs unchanged on the smaller cache. Generated
tokens keep their original positions because transformers derives them from the attention mask, not from the
(compressed) cache length; the question mode passes them explicitly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn
from transformers import Cache, DynamicCache

from .allocation import apportion
from .artifact import Artifact, load_artifact
from .attention import KEEP_MASK_KEYWORD, per_layer_attention
from .cache_ops import attention_modules, cache_bytes, check_full_attention_cache, keep_entries
from .errors import KVRuntimeError, UnsupportedModelError
from .methods import LayerPrefill, Method, Prefill, get_method
from .report import CompressionReport
from .request import DEFAULT_METHOD, Request
from .second_pass import task_attention_maxima
from .selection import top_indices, top_mask
from .tuned_defaults import TunedDefaults
from .window import hooked_window_queries

# Attribute a model carries while a compression block is attached to it (blocks do not nest).
_ACTIVE_SESSION = "_kvruntime_session"


@dataclasses.dataclass
class _Prefill:
    """Running state of one prefill: the prompt, each layer's statistics gathered so far, and timings."""

    length: int
    started: float
    input_ids: torch.Tensor | None
    statistics: dict[int, object] = dataclasses.field(default_factory=dict)
    scoring_seconds: float = 0.0


class CompressionSession:
    """Hooks and state of one `compress(...)` block. `reports` lists one report per compressed prefill."""

    def __init__(
        self,
        model: nn.Module,
        method: Method,
        ratio: float | None,
        budget: int | None,
        memory: str,
        artifacts: Sequence[Artifact] = (),
    ) -> None:
        self.request = Request(ratio, budget, memory)
        method.check_request(self.request)
        if method.required_memory() not in (None, memory):
            raise KVRuntimeError(
                f"{method.name} with these options keeps different numbers of entries per head: use "
                f"memory={method.required_memory()!r}"
            )
        self.model = model
        self.method = method
        self.artifacts = list(artifacts)
        self.reports: list[CompressionReport] = []
        # Original positions of the entries each layer kept in the latest compression, [B, Hkv, slots] per layer.
        self.kept_positions: list[torch.Tensor] = []
        self._attention = attention_modules(model)
        self._prefill: _Prefill | None = None
        # Per compressed cache, the masks of its layers whose heads keep fewer entries than their slots (`masked`
        # memory): they belong to that cache's entries, and go when it goes.
        self._keep_masks: weakref.WeakKeyDictionary[Cache, dict[int, torch.Tensor]] = weakref.WeakKeyDictionary()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    @property
    def ratio(self) -> float | None:
        return self.request.ratio

    @property
    def budget(self) -> int | None:
        return self.request.budget

    @property
    def memory(self) -> str:
        return self.request.memory

    def keep_masks(self, cache: Cache) -> dict[int, torch.Tensor]:
        """The keep masks of a cache this session compressed ({} when every head shows all its slots)."""
        return self._keep_masks.get(cache, {})

    @property
    def report(self) -> CompressionReport:
        """The report of the latest compressed prefill."""
        if not self.reports:
            raise KVRuntimeError("nothing was compressed yet: run a prefill (generate or prefill) inside the block")
        return self.reports[-1]

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def prefill(self, input_ids: torch.Tensor) -> CompressedContext:
        """Compress a context on its own (without the question) and return it, ready for several questions."""
        if not self.active:
            raise KVRuntimeError("prefill inside the `with kvruntime.compress(...)` block: the block has ended")
        if input_ids.ndim != 2 or input_ids.shape[1] < 2:
            raise KVRuntimeError(
                f"a context of {input_ids.shape[-1] if input_ids.ndim else 0} token(s) has nothing to compress: give at least 2"
            )
        cache = DynamicCache(config=self.model.config)
        with torch.no_grad():
            self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return CompressedContext(self, cache, input_ids.shape[1], self.report)

    # -- hooks ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def attached(self) -> Iterator[CompressionSession]:
        base = self.model.base_model
        if getattr(self.model, _ACTIVE_SESSION, None) is not None:
            raise KVRuntimeError("this model is already inside a `kvruntime.compress(...)` block: blocks do not nest")
        setattr(self.model, _ACTIVE_SESSION, self)
        self._handles = [
            base.register_forward_pre_hook(self._before_model, with_kwargs=True),
            base.register_forward_hook(self._after_model, with_kwargs=True),
        ]
        for module in self._attention:
            self._handles.append(module.register_forward_hook(self._after_attention, with_kwargs=True))
            self._handles.append(module.register_forward_pre_hook(self._inject_keep_mask, with_kwargs=True))
        try:
            yield self
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            delattr(self.model, _ACTIVE_SESSION)

    def _before_model(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = kwargs["inputs_embeds"]
        cache = kwargs.get("past_key_values")
        batch, length = tokens.shape[:2]
        starts_empty = cache is None or cache.get_seq_length() == 0
        if starts_empty and cache is not None:  # a new sequence: an earlier prompt's keep masks do not apply to it
            self._keep_masks.pop(cache, None)
        if not starts_empty or length < 2 or kwargs.get("use_cache") is False:
            return
        if batch != 1:
            raise UnsupportedModelError(f"kvruntime compresses batch size 1 only (got a batch of {batch})")
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2 and not bool(mask.all()):
            raise UnsupportedModelError("padded inputs are not supported: pass one unpadded prompt")
        ids = tokens if tokens.dtype in (torch.long, torch.int) else None
        self._prefill = _Prefill(length=length, started=time.perf_counter(), input_ids=ids)

    def _after_attention(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        state = self._prefill
        if state is None:
            return
        started = time.perf_counter()
        with torch.no_grad():
            queries, cache_layer, _ = hooked_window_queries(module, args, kwargs, self.method.window)
            hidden_states = kwargs.get("hidden_states", args[0] if args else None)
            layer = LayerPrefill(
                module.layer_idx, queries, cache_layer.keys, cache_layer.values, module.scaling, hidden_states
            )
            state.statistics[module.layer_idx] = self.method.layer_statistics(layer)
        state.scoring_seconds += time.perf_counter() - started

    def _after_model(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        state, self._prefill = self._prefill, None
        if state is None:
            return
        cache = getattr(output, "past_key_values", None)
        if cache is None:
            return
        started = time.perf_counter()
        before = cache_bytes(cache)
        prefill = Prefill(
            length=state.length,
            num_kv_heads=cache.layers[0].keys.shape[1],
            input_ids=state.input_ids,
            hidden_states=output.last_hidden_state,
            output_embeddings=self.model.get_output_embeddings(),
            second_pass_attention=lambda: self._second_pass(cache, state),
        )
        with torch.no_grad():  # a prefill run outside no_grad must not build graphs through the selection
            slots, entries, notes = self._compress_cache(cache, state, prefill)
        ended = time.perf_counter()
        self.reports.append(
            CompressionReport(
                method=self.method.name,
                memory=self.memory,
                requested=self.request.describe(),
                context_length=state.length,
                num_kv_heads=cache.layers[0].keys.shape[1],
                slots_per_layer=slots,
                entries_per_layer=entries,
                bytes_before=before,
                bytes_after=cache_bytes(cache),
                prefill_seconds=started - state.started - state.scoring_seconds,
                compress_seconds=state.scoring_seconds + ended - started,
                notes=notes,
            )
        )

    def _inject_keep_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        cache = kwargs.get("past_key_values")
        mask = self._keep_masks.get(cache, {}).get(module.layer_idx) if cache is not None else None
        if mask is None or self._prefill is not None:
            return None
        return args, {**kwargs, KEEP_MASK_KEYWORD: mask}

    def _second_pass(self, cache: Cache, state: _Prefill) -> list[torch.Tensor]:
        """The prompt fed again after itself (`Prefill.second_pass_attention`), timed as part of the scoring."""
        if state.input_ids is None:
            raise KVRuntimeError(
                f"{self.method.name}'s scoring pass feeds the prompt again: give token ids, not embeddings"
            )
        return task_attention_maxima(self.model, cache, state.input_ids, state.length)

    # -- selection -----------------------------------------------------------------------------------------
    def _compress_cache(
        self, cache: Cache, state: _Prefill, prefill: Prefill
    ) -> tuple[list[int], list[int], list[str]]:
        check_full_attention_cache(cache)
        window = min(self.method.window, state.length)
        keep = self.request.kept_per_head(state.length, window)
        asked = self.request.kept_per_head(state.length, 1)
        # Why the cache held may differ from the request: the report says it rather than hide it.
        notes = (
            [f"window              the last {window} tokens always stay: {keep} kept per layer, not {asked}"]
            if keep > asked
            else []
        )
        self.kept_positions = []
        if keep >= state.length:
            full = [state.length] * len(cache.layers)
            return full, [state.length * layer.keys.shape[1] for layer in cache.layers], notes
        if len(state.statistics) != len(cache.layers):
            raise UnsupportedModelError(
                f"scored {len(state.statistics)} attention layers but the cache has {len(cache.layers)}"
            )
        statistics = [state.statistics[i] for i in range(len(cache.layers))]
        selection = self.method.select(statistics, self.request, prefill)
        counts = selection.counts
        if int(counts.max()) > state.length:
            raise KVRuntimeError(f"{self.method.name} selected more entries per head than the context holds")
        if self.memory == "padded" and bool((counts != counts.amax(dim=1, keepdim=True)).any()):
            # Every head of a layer gets the same number of slots: the layer's share of what the method selected,
            # so that the cache held is the requested size (padding each layer to its largest head count held more).
            shares = apportion(counts.sum(dim=1).double(), int(counts.sum()) // counts.shape[1], window, state.length)
            counts = shares[:, None].expand_as(counts)
            notes.append(
                "padded              each layer's slots are its share of the selection, spread over its KV heads"
            )
        slots, entries, masks = [], [], {}
        for index, (layer, scores) in enumerate(zip(cache.layers, selection.scores)):
            slot_count = int(counts[index].max())
            indices = top_indices(scores, slot_count)
            keep_entries(layer, indices)
            self.kept_positions.append(indices)
            slots.append(slot_count)
            head_counts = counts[index] if self.memory == "masked" else torch.full_like(counts[index], slot_count)
            entries.append(int(head_counts.sum()))
            if self.memory == "masked" and bool((head_counts < slot_count).any()):
                # Slots beyond a head's own count are hidden from attention: the method's exact selection.
                masks[index] = top_mask(scores.gather(-1, indices), head_counts)
        self._keep_masks[cache] = masks
        return slots, entries, notes + selection.notes


class CompressedContext:
    """A context compressed without its question; answers questions one after another on the same cache."""

    def __init__(
        self, session: CompressionSession, cache: Cache, context_length: int, report: CompressionReport
    ) -> None:
        self.session = session
        self.cache = cache
        self.context_length = context_length
        self.report = report

    @property
    def keep_masks(self) -> dict[int, torch.Tensor]:
        """The keep masks of the compressed cache's layers (`masked` memory), held with the cache they describe."""
        return self.session.keep_masks(self.cache)

    def generate(self, question_ids: torch.Tensor, **generate_kwargs) -> object:
        """`model.generate` on the question `question_ids` [1, q] after the compressed context; returns what
        generate returns (sequences start with the question). The compressed context is restored afterwards
        (zero-copy: transformers' cache update makes new tensors, the originals are kept)."""
        if not self.session.active:
            raise KVRuntimeError(
                "answer questions inside the `with kvruntime.compress(...)` block that made the context"
            )
        saved = [(layer.keys, layer.values) for layer in self.cache.layers]
        try:
            return generate_after_context(
                self.session.model, self.cache, self.context_length, question_ids, **generate_kwargs
            )
        finally:
            for layer, (keys, values) in zip(self.cache.layers, saved):
                layer.keys, layer.values = keys, values


def generate_after_context(
    model: nn.Module, cache: Cache, context_length: int, question_ids: torch.Tensor, **generate_kwargs
) -> object:
    """`model.generate` on `question_ids` [1, q] after a context of `context_length` tokens held (compressed or
    not) in `cache`: the question takes its original positions after the full context. A cache whose layers hold
    different lengths needs `per_layer_attention` around this call."""
    question_length = question_ids.shape[1]
    positions = torch.arange(context_length, context_length + question_length, device=question_ids.device)
    attention_mask = torch.ones(1, context_length + question_length, dtype=torch.long, device=question_ids.device)
    explicit = {"position_ids": positions[None]}
    if hasattr(model, "_get_initial_cache_position"):
        # transformers < 5.3 (kvpress's range) derives cache positions from the compressed cache length.
        explicit["cache_position"] = positions
    return model.generate(
        input_ids=question_ids, attention_mask=attention_mask, past_key_values=cache, **explicit, **generate_kwargs
    )


@contextlib.contextmanager
def compress(
    model: nn.Module,
    method: str | Method | None = None,
    ratio: float | None = None,
    budget: int | None = None,
    memory: str = "padded",
    artifacts: Sequence[str | os.PathLike] = (),
    force: bool = False,
    options: Mapping[str, object] = {},
) -> Iterator[CompressionSession]:
    """Compress the KV cache of every prefill run inside the block.

    method: a method name or instance; None takes the method and ratio of a `tuned_defaults` artifact among
    `artifacts` (written by `kvcompile tune`), or `kvcompress` when there is none.
    ratio: fraction of cache entries removed, in [0, 1); budget: tokens kept per layer (give one of the two).
    memory: how per-head counts that differ inside a layer are stored: `padded` (default) gives every head of a
    layer the layer's largest count, filled with each head's next-best tokens; `masked` uses the same slots but
    hides the entries beyond each head's own count (the method's exact selection). Both free the same bytes.
    artifacts: compiled artifacts the method needs (`kvruntime.methods.required_artifact_kinds`), checked against
    the model first (refused if compiled for another model).
    options: settings of a method given by name (compilerkv: `nearest_budget`, `uniform_heads`, `fixed_threshold`).
    """
    loaded = [load_artifact(path, model=model, force=force) for path in artifacts]
    tuned = [a for a in loaded if a.kind == "tuned_defaults"]
    if method is None and tuned:
        defaults = TunedDefaults.from_artifact(tuned[0])
        method, options = defaults.method, options or defaults.options
        if ratio is None and budget is None:
            ratio = defaults.ratio
        present = {a.path.resolve() for a in loaded if a.path is not None}
        loaded += [
            load_artifact(p, model=model, force=force) for p in defaults.artifact_files if p.resolve() not in present
        ]
    session = CompressionSession(
        model, get_method(method or DEFAULT_METHOD, loaded, options), ratio, budget, memory, loaded
    )
    with per_layer_attention(model), session.attached():
        yield session
