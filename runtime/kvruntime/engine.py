"""The compression engine: the KV cache compressed during or at the end of prefill.

`compress(model, method, ratio=...)` is a context manager. Inside it, the base model's forward is wrapped: every
forward pass that starts on an empty cache with more than one token is a prefill, which the wrapper drives (a
batch's rows and a long prompt's chunks, one forward each), and the hook of each attention layer whose cache grows
takes the last `window` queries the model computed (captured where its attention runs) and hands them, with the
layer's keys and values, to the method, which keeps its statistics (for
most methods, token scores from window attention); when the whole model has run, the method selects what each
(layer, KV head) keeps and the cache is cut to it. A method whose layer budgets are known in advance has each layer
cut right after its attention instead (one layer at a time holds its full cache), and with `prefill_chunk_size` the
prompt goes in chunks, every layer cut after each (the cache held never exceeds the budgets plus one chunk in one
layer). Decoding then runs unchanged on the smaller cache. Generated tokens keep their original positions because
transformers derives them from the attention mask, not from the (compressed) cache length; the question mode passes
them explicitly.

A batch (left-padded, as transformers' generation pads) is prefilled row by row: each row's own tokens go through the
model alone and are compressed exactly as that prompt alone would be; the rows' caches are then stacked into one
rectangular cache (each layer as long as its longest row, the slots after a row's entries hidden from attention),
and decoding runs batched on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import nn
from transformers import Cache, DynamicCache

from .allocation import apportion
from .artifact import Artifact, load_artifact
from .attention import KEEP_MASK_KEYWORD, captured_logits, capturing_queries, per_layer_attention
from .batch_rows import row_starts, stack_rows, stacked_visibility, with_appended
from .bundle import artifact_files
from .cache_ops import (
    attention_modules,
    bounded_bytes,
    cache_argument,
    cache_bytes,
    check_growing_layer,
    hooked_cache,
    keep_entries,
    output_cache,
    own_window_storage,
    own_window_storage_of,
    replace_output,
    restored_after,
    uncompressed_bytes,
    window_attention_modules,
)
from .errors import KVRuntimeError, UnsupportedModelError
from .methods import LayerPrefill, Method, Prefill, check_prefill_chunk_size, get_method
from .model_spec import check_positions
from .quantized_cache import KV_BITS, check_kv_bits, quantize_cache, quantized_layer
from .recording import RECORDED_QUERIES, PrefillRecording
from .registry import DEFAULT_METHOD
from .report import BatchReport, CompressionReport
from .request import KeepPlan, Request
from .second_pass import task_attention_maxima
from .selection import top_indices, top_mask
from .serving import check_memory
from .tuned_defaults import TunedDefaults
from .window import hooked_input, hooked_window_queries

# Attribute a model carries while a compression block is attached to it (blocks do not nest).
_ACTIVE_SESSION = "_kvruntime_session"


@dataclasses.dataclass
class _HeldEntries:
    """What a layer cut inside the prefill holds: its entries' original positions and scores [B, Hkv, held], and
    what the method carries to the layer's next chunk."""

    positions: torch.Tensor
    scores: torch.Tensor
    carry: object = None


@dataclasses.dataclass
class _Prefill:
    """Running state of one prefill: the prompt, each layer's statistics gathered so far (or, when layers are cut
    inside the prefill, their budgets and what they hold), the chunk going in, the largest cache held, timings."""

    length: int
    started: float
    input_ids: torch.Tensor | None
    plan: KeepPlan  # what this prompt keeps: decided once, here
    statistics: dict[int, object] = dataclasses.field(default_factory=dict)
    scoring_seconds: float = 0.0
    budgets: list[int] | None = None  # tokens each layer keeps, when every layer is cut right after its attention
    held: dict[int, _HeldEntries] = dataclasses.field(default_factory=dict)
    chunks: int = 1  # the prompt went in this many chunks
    chunk_start: int = 0  # position of the first token of the chunk going in
    final_chunk: bool = True
    peak_bytes: int = 0  # the largest KV cache held at the end of an attention layer

    def path(self) -> str:
        """Where the cache was cut, for the report."""
        if self.budgets is None:
            return "after the prefill (the method's layer budgets need every layer's scores)"
        if self.chunks == 1:
            return "per layer, right after its attention"
        return f"per layer, after each of {self.chunks} chunks of the prompt"


class CompressionSession:
    """Hooks and state of one `compress(...)` block. `reports` lists one report per compressed prefill."""

    def __init__(
        self,
        model: nn.Module,
        method: Method,
        ratio: float | None,
        budget: int | None,
        memory: str,
        prefill_chunk_size: int | None = None,
        kv_bits: int | None = None,
    ) -> None:
        self.request = Request(ratio, budget, memory)
        method.check_request(self.request)
        check_prefill_chunk_size(method, prefill_chunk_size)
        check_memory(method.name, method.required_memory(), memory)
        check_kv_bits(kv_bits)
        # The layers every method scores and cuts (a method's layer i is the i-th), and the sliding-window ones,
        # which the model bounds itself and which are left to it.
        self._attention = attention_modules(model)
        self._windows = window_attention_modules(model)
        self._bounded = [module.layer_idx for module in self._windows]
        if kv_bits is not None and self._bounded:
            raise KVRuntimeError(
                "kv_bits quantizes the cache's growing layers and would turn the sliding-window ones into plain "
                "layers: not on a model with sliding-window layers"
            )
        if kv_bits is not None:
            quantized_layer(kv_bits)  # refuses a transformers without that layer before any prefill
        self.kv_bits = kv_bits  # the kept entries are quantized to this many bits once cut (`quantized_cache`)
        self.model = model
        self.method = method
        self.reports: list[CompressionReport] = []  # one per compressed prompt (per row of a batch)
        self.batch_reports: list[BatchReport] = []  # one per compressed batch
        # Original positions of the entries each layer kept in the latest compression, [B, Hkv, slots] per layer.
        self.kept_positions: list[torch.Tensor] = []
        self._position = {module: position for position, module in enumerate(self._attention)}
        self.prefill_chunk_size = prefill_chunk_size
        # The prefill going through the model now (set and cleared by `_forward`): what the attention hooks feed.
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

    @contextlib.contextmanager
    def masking(self, cache: Cache, masks: dict[int, torch.Tensor]) -> Iterator[None]:
        """`masks` hide entries of `cache` from attention inside the block (a question's padding beside the
        context's); the cache's own keep masks are back after it."""
        own = self._keep_masks.get(cache, {})
        self._keep_masks[cache] = masks
        try:
            yield
        finally:
            self._keep_masks[cache] = own

    @property
    def report(self) -> CompressionReport:
        """The report of the latest compressed prefill."""
        if not self.reports:
            raise KVRuntimeError("nothing was compressed yet: run a prefill (generate or prefill) inside the block")
        return self.reports[-1]

    @property
    def batch_report(self) -> BatchReport:
        """The report of the latest compressed batch: each row's report and the batch's bytes held."""
        if not self.batch_reports:
            raise KVRuntimeError("no batch was compressed yet: give generate or prefill several prompts")
        return self.batch_reports[-1]

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> CompressedContext:
        """Compress a context on its own (without the question) and return it, ready for several questions.
        A batch of contexts is left-padded, with its `attention_mask` (1 for a token, 0 for padding)."""
        if not self.active:
            raise KVRuntimeError("prefill inside the `with kvruntime.compress(...)` block: the block has ended")
        if input_ids.ndim != 2 or input_ids.shape[1] < 2:
            raise KVRuntimeError(
                f"a context of {input_ids.shape[-1] if input_ids.ndim else 0} token(s) has nothing to compress: give at least 2"
            )
        cache = DynamicCache(config=self.model.config)
        counts = len(self.reports), len(self.batch_reports)
        with torch.no_grad():
            self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                **cache_argument(self.model, cache),
                use_cache=True,
                logits_to_keep=1,
            )
        if len(self.batch_reports) > counts[1]:
            report: CompressionReport | BatchReport = self.batch_reports[-1]
        elif len(self.reports) > counts[0]:
            report = self.reports[-1]
        else:
            raise KVRuntimeError("the context was not compressed")
        lengths = (
            [input_ids.shape[1]] * input_ids.shape[0] if attention_mask is None else attention_mask.sum(1).tolist()
        )
        return CompressedContext(self, cache, lengths, report)

    def streams(self, length: int) -> bool:
        """Whether a prompt of `length` tokens goes in chunks (`prefill_chunk_size`)."""
        return self.prefill_chunk_size is not None and length > self.prefill_chunk_size

    def replays(self, length: int) -> bool:
        """Whether a recorded plain prefill of `length` tokens can be compressed as this session would compress
        it (`compress_recording`)."""
        return not self.streams(length) and self.method.window <= RECORDED_QUERIES

    def compress_recording(self, recording: PrefillRecording) -> CompressedContext:
        """The context of a recorded plain prefill, compressed as `prefill` compresses it, without a forward of its
        own: the hooks run on the recorded calls (`PrefillRecording.replay`). Its report's prefill time is the
        hooks' alone: the forward is the recording's. Not for a prompt this session streams in chunks, nor for a
        method whose window is longer than the queries recorded (`replays`)."""
        if not self.active:
            raise KVRuntimeError("compress inside the `with kvruntime.compress(...)` block: the block has ended")
        if self.streams(recording.length):
            raise KVRuntimeError(
                f"a prompt streamed in chunks of {self.prefill_chunk_size} tokens is not a recorded prefill of one piece"
            )
        if self.method.window > RECORDED_QUERIES:
            raise KVRuntimeError(
                f"a window of {self.method.window} queries is longer than a recording's {RECORDED_QUERIES}: prefill"
            )
        if not recording.holds_the_whole_prompt():
            raise KVRuntimeError(
                "this recording holds a compressed cache (recorded inside a `kvruntime.compress` block): record the "
                "plain prefill before the block"
            )
        state = self._new_prefill(recording.input_ids)
        with torch.no_grad(), self._feeding(state):
            cache, output = recording.replay(self.model, self._after_attention)
        self._finish(state, output)
        return CompressedContext(self, cache, [recording.length], self.reports[-1])

    # -- hooks ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def attached(self) -> Iterator[CompressionSession]:
        base = self.model.base_model
        if getattr(self.model, _ACTIVE_SESSION, None) is not None:
            raise KVRuntimeError("this model is already inside a `kvruntime.compress(...)` block: blocks do not nest")
        setattr(self.model, _ACTIVE_SESSION, self)
        # The base model's forward, wrapped while attached: a prefill goes through `_forward`, which drives its
        # rows and chunks; every other forward (decoding, a second pass) goes through unchanged.
        own_forward = base.__dict__.get("forward")  # an instance's own forward (accelerate's hooks set one)
        forward = base.forward
        base.forward = functools.wraps(forward)(functools.partial(self._forward, forward))
        for module in self._attention:
            self._handles.append(module.register_forward_hook(self._after_attention, with_kwargs=True))
            self._handles.append(module.register_forward_pre_hook(self._inject_keep_mask, with_kwargs=True))
        for module in self._windows:
            self._handles.append(module.register_forward_hook(self._after_window_attention, with_kwargs=True))
        try:
            with capturing_queries(self._attention, self.method.window):
                yield self
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            if own_forward is None:
                del base.forward
            else:
                base.forward = own_forward
            delattr(self.model, _ACTIVE_SESSION)

    def _forward(self, forward: Callable[..., object], *args: object, **kwargs: object) -> object:
        """The base model's forward while attached: a prefill (an empty cache, two tokens or more) is compressed,
        a batch or a padded prompt row by row, a long prompt in chunks (`prefill_chunk_size`)."""
        if args:  # the input ids given by position: pass them on by name, as the rows and chunks are
            kwargs, args = {**kwargs, "input_ids": args[0]}, args[1:]
        tokens_key = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
        tokens = kwargs[tokens_key]
        cache = hooked_cache(kwargs)
        batch, length = tokens.shape[:2]
        starts_empty = cache is None or cache.get_seq_length() == 0
        if starts_empty and cache is not None:  # a new sequence: an earlier prompt's keep masks do not apply to it
            self._keep_masks.pop(cache, None)
        if not starts_empty or length < 2 or kwargs.get("use_cache") is False:
            return forward(*args, **kwargs)
        mask = kwargs.get("attention_mask")
        if batch != 1 or (isinstance(mask, torch.Tensor) and mask.ndim == 2 and not bool(mask.all())):
            return self._prefill_rows(kwargs, tokens_key, cache)
        check_positions(
            length, getattr(self.model.config, "max_position_embeddings", None), f"a prompt of {length} tokens"
        )
        state = self._new_prefill(tokens)
        with self._feeding(state):
            if self.streams(length) and cache is not None:
                bounds = chunk_bounds(length, self.prefill_chunk_size)
                kwargs = self._feed_earlier_chunks(forward, kwargs, tokens_key, bounds, state)
            output = forward(*args, **kwargs)
        self._finish(state, output)
        return output

    @contextlib.contextmanager
    def _feeding(self, state: _Prefill) -> Iterator[None]:
        """The attention hooks feed `state` inside the block, and nothing after it (an error included)."""
        self._prefill = state
        try:
            yield
        finally:
            self._prefill = None

    def _new_prefill(self, tokens: torch.Tensor) -> _Prefill:
        """The state of a prefill of `tokens` [1, N] (ids, or embeddings [1, N, hidden]) starting now."""
        length = tokens.shape[1]
        ids = tokens if tokens.dtype in (torch.long, torch.int) else None
        reading = None if ids is not None else self.method.reads_token_ids()
        if reading:
            raise KVRuntimeError(
                f"{self.method.name}'s {reading} read the prompt's token ids, and a prompt given as inputs_embeds has "
                "none: give input_ids, or turn those options off"
            )
        plan = self.request.plan(length, self.method.window, None if ids is None else ids[0])
        state = _Prefill(length=length, started=time.perf_counter(), input_ids=ids, plan=plan)
        if self.method.budgets_known_in_advance:
            state.budgets = self.method.layer_budgets(len(self._attention), plan)
        return state

    def _prefill_rows(self, kwargs: dict, tokens_key: str, cache: Cache | None) -> object:
        """A batch, or a padded prompt: each row's own tokens go through the model alone, at batch size 1, and are
        compressed as that prompt alone would be (padding never enters a row's cache, each row keeps its own ratio
        or budget of its own length; second-pass methods and streaming work as alone). The rows' caches are then
        stacked into `cache`; the output holds the rows' hidden states and the stacked cache."""
        tokens = kwargs[tokens_key]
        batch, length = tokens.shape[:2]
        if self.kv_bits is not None:
            raise KVRuntimeError("kv_bits quantizes one prompt at a time: give the prompts one by one")
        if self._bounded:  # a row's sliding layers would be padded out of the order their band relies on
            raise KVRuntimeError(
                "a batch (or a padded prompt) on a model with sliding-window layers: give the prompts one by one"
            )
        starts = row_starts(kwargs.get("attention_mask"), batch, length)
        alone = {
            key: value
            for key, value in kwargs.items()
            if key not in ("attention_mask", "position_ids", "cache_position", "cache", "past_key_values")
        }
        first_report = len(self.reports)
        hidden, row_caches, row_positions = None, [], []
        for row, start in enumerate(starts):
            row_cache = DynamicCache(config=self.model.config)
            row_tokens = tokens[row : row + 1, start:]
            output = self.model.base_model(**{**alone, tokens_key: row_tokens, **cache_argument(self.model, row_cache)})
            states = output.last_hidden_state
            if hidden is None:
                hidden = states.new_zeros(batch, length, states.shape[-1])
            # Right-aligned: a streamed prompt's output holds its last chunk only, as it does alone.
            hidden[row, length - states.shape[1] :] = states[0]
            row_caches.append(row_cache)
            # A row short enough to keep whole was not cut: its entries are its positions in order.
            every = torch.arange(row_tokens.shape[1], device=tokens.device).expand(
                1, row_cache.layers[0].keys.shape[1], -1
            )
            row_positions.append(self.kept_positions or [every] * len(row_cache.layers))
        cache = cache if cache is not None else DynamicCache(config=self.model.config)
        masks, self.kept_positions = {}, []
        for index in range(len(row_caches[0].layers)):
            layers = [row_cache.layers[index] for row_cache in row_caches]
            cache.update(
                stack_rows([layer.keys for layer in layers]), stack_rows([layer.values for layer in layers]), index
            )
            visible = stacked_visibility(
                [layer.keys.shape[2] for layer in layers],
                [self._keep_masks.get(row_cache, {}).get(index) for row_cache in row_caches],
                layers[0].keys.shape[1],
                tokens.device,
            )
            if visible is not None:
                masks[index] = visible
            self.kept_positions.append(stack_rows([positions[index] for positions in row_positions], fill=-1))
        self._keep_masks[cache] = masks
        self.batch_reports.append(
            BatchReport(self.reports[first_report:], uncompressed_bytes(cache, length), cache_bytes(cache))
        )
        return replace_output(output, hidden, cache)

    def _feed_earlier_chunks(
        self,
        forward: Callable[..., object],
        kwargs: dict,
        tokens_key: str,
        bounds: list[tuple[int, int]],
        state: _Prefill,
    ) -> dict:
        """Run every chunk but the last through the model's `forward` (each layer is cut after each chunk), and
        return the arguments of the last chunk, whose output is the prefill's.
        Positions are given explicitly: the cache, cut, no longer says how far the prompt has gone."""
        tokens = kwargs[tokens_key]
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)[None]

        def chunk_arguments(start: int, end: int) -> dict:
            sliced = {tokens_key: tokens[:, start:end], "attention_mask": None}
            return {**kwargs, **sliced, **explicit_positions(self.model, positions[0, start:end])}

        state.chunks = len(bounds)
        for start, end in bounds[:-1]:
            state.chunk_start, state.final_chunk = start, False
            forward(**chunk_arguments(start, end))
        state.chunk_start, state.final_chunk = bounds[-1][0], True
        return chunk_arguments(*bounds[-1])

    def _after_attention(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        state = self._prefill
        if state is None:
            return
        started = time.perf_counter()
        with torch.no_grad():
            queries, cache_layer, _ = hooked_window_queries(module, args, kwargs, self.method.window)
            hidden_states = hooked_input(args, kwargs)
            layer = LayerPrefill(
                self._position[module],
                queries,
                cache_layer.keys,
                cache_layer.values,
                captured_logits(module),
                hidden_states,
                start=state.chunk_start,
                final=state.final_chunk,
                plan=state.plan,
            )
            state.peak_bytes = max(state.peak_bytes, cache_bytes(hooked_cache(kwargs)))
            if state.budgets is None:
                state.statistics[layer.index] = self.method.layer_statistics(layer)
            else:
                check_growing_layer(cache_layer, module.layer_idx)
                self._cut_layer(cache_layer, layer, state)
        state.scoring_seconds += time.perf_counter() - started

    def _after_window_attention(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        """A sliding-window layer in a prefill lets the prompt's keys and values go once it has attended: the cache
        held stays its window, not the prompt."""
        if self._prefill is not None:
            own_window_storage_of(hooked_cache(kwargs).layers[module.layer_idx])

    def _cut_layer(self, cache_layer: object, layer: LayerPrefill, state: _Prefill) -> None:
        """Keep the layer's best entries under its budget, right after its attention (one chunk of the prompt went
        in: the whole prompt when it is not streamed)."""
        earlier = state.held.get(layer.index)
        if earlier is None:
            scores, carry = self.method.stream_scores(layer, None, None)
        else:
            scores, carry = self.method.stream_scores(layer, earlier.scores, earlier.carry)
        fresh = torch.arange(layer.start, layer.start + layer.hidden_states.shape[1], device=scores.device)
        positions = fresh.expand(*scores.shape[:2], -1)
        if earlier is not None:
            positions = torch.cat([earlier.positions, positions], dim=-1)
        if scores.shape[-1] != positions.shape[-1]:
            raise KVRuntimeError(
                f"{self.method.name} scored {scores.shape[-1]} entries, the layer holds {positions.shape[-1]}"
            )
        budget = min(state.budgets[layer.index], scores.shape[-1])
        if budget < scores.shape[-1]:
            indices = top_indices(scores, budget)
            keep_entries(cache_layer, indices)
            scores, positions = scores.gather(-1, indices), positions.gather(-1, indices)
        state.held[layer.index] = _HeldEntries(positions, scores, carry)

    def _finish(self, state: _Prefill, output: object) -> None:
        """Compress the cache of a prefill that went through (`output`'s), and report it."""
        cache = output_cache(output)
        if cache is None:
            return
        started = time.perf_counter()
        peak = max(cache_bytes(cache), state.peak_bytes)
        prefill = Prefill(
            length=state.length,
            num_kv_heads=cache.layers[0].keys.shape[1],
            input_ids=state.input_ids,
            hidden_states=output.last_hidden_state,
            output_embeddings=self.model.get_output_embeddings(),
            second_pass_attention=functools.partial(self._second_pass, cache, state),
        )
        with torch.no_grad():  # a prefill run outside no_grad must not build graphs through the selection
            slots, entries, notes = self._compress_cache(cache, state, prefill)
            own_window_storage(cache)
            num_kv_heads, full_bytes = cache.layers[0].keys.shape[1], uncompressed_bytes(cache, state.length)
            if self.kv_bits is not None:
                quantize_cache(cache, self.kv_bits)
                notes = [*notes, f"kept entries quantized to {KV_BITS[self.kv_bits]}"]
        ended = time.perf_counter()
        report = CompressionReport(
            method=self.method.name,
            memory=self.memory,
            requested=self.request.describe(),
            context_length=state.length,
            num_kv_heads=num_kv_heads,
            slots_per_layer=slots,
            entries_per_layer=entries,
            bytes_before=full_bytes,
            bytes_after=cache_bytes(cache),
            peak_bytes=peak,
            prefill_seconds=started - state.started - state.scoring_seconds,
            compress_seconds=state.scoring_seconds + ended - started,
            cut=state.path(),
            notes=notes,
            layers=[module.layer_idx for module in self._attention],
            bounded_layers=self._bounded,
            bounded_bytes=bounded_bytes(cache),
        )
        self.reports.append(report)

    def _inject_keep_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        cache = hooked_cache(kwargs)
        mask = self._keep_masks.get(cache, {}).get(module.layer_idx) if cache is not None else None
        if mask is None or self._prefill is not None:
            return None
        return args, {**kwargs, KEEP_MASK_KEYWORD: mask}

    def _second_pass(
        self, cache: Cache, state: _Prefill, prefix: tuple[int, ...] = (), target: str = "attention"
    ) -> list[torch.Tensor]:
        """The prompt fed again after itself (`Prefill.second_pass_attention`), timed as part of the scoring."""
        if state.input_ids is None:
            raise KVRuntimeError(
                f"{self.method.name}'s scoring pass feeds the prompt again: give token ids, not embeddings"
            )
        ids = state.input_ids
        task = torch.cat([torch.tensor([prefix], dtype=ids.dtype, device=ids.device).expand(ids.shape[0], -1), ids], 1)
        return task_attention_maxima(self.model, cache, task, state.length, target=target)

    # -- selection -----------------------------------------------------------------------------------------
    def _growing_layers(self, cache: Cache) -> list[object]:
        """The cache layers the method cuts, in its order (`attention_modules`)."""
        layers = [cache.layers[module.layer_idx] for module in self._attention]
        for module, layer in zip(self._attention, layers):
            check_growing_layer(layer, module.layer_idx)
        return layers

    def _compress_cache(
        self, cache: Cache, state: _Prefill, prefill: Prefill
    ) -> tuple[list[int], list[int], list[str]]:
        layers = self._growing_layers(cache)
        plan = state.plan
        window, keep = plan.window, plan.keep
        # Why the cache held may differ from the request: the report says it rather than hide it.
        notes = (
            [f"window              the last {window} tokens always stay: {keep} kept per layer, not {plan.asked}"]
            if keep > plan.asked
            else []
        )
        self.kept_positions = []
        if state.budgets is not None:
            return self._layers_cut(cache, layers, state, notes)
        if keep >= state.length:
            full = [state.length] * len(layers)
            return full, [state.length * layer.keys.shape[1] for layer in layers], notes
        if len(state.statistics) != len(layers):
            raise UnsupportedModelError(
                f"scored {len(state.statistics)} attention layers but the cache has {len(layers)}"
            )
        statistics = [state.statistics[i] for i in range(len(layers))]
        selection = self.method.select(statistics, plan, prefill)
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
        for index, (layer, scores) in enumerate(zip(layers, selection.scores)):
            slot_count = int(counts[index].max())
            indices = top_indices(scores, slot_count)
            keep_entries(layer, indices)
            self.kept_positions.append(indices)
            slots.append(slot_count)
            head_counts = counts[index] if self.memory == "masked" else torch.full_like(counts[index], slot_count)
            entries.append(int(head_counts.sum()))
            if self.memory == "masked" and bool((head_counts < slot_count).any()):
                # Slots beyond a head's own count are hidden from attention: the method's exact selection.
                masks[self._attention[index].layer_idx] = top_mask(scores.gather(-1, indices), head_counts)
        self._keep_masks[cache] = masks
        return slots, entries, notes + selection.notes

    def _layers_cut(
        self, cache: Cache, layers: list[object], state: _Prefill, notes: list[str]
    ) -> tuple[list[int], list[int], list[str]]:
        """What the layers cut inside the prefill hold: slots and entries per layer (every head the same count)."""
        if len(state.held) != len(layers):
            raise UnsupportedModelError(f"cut {len(state.held)} attention layers but the cache has {len(layers)}")
        self.kept_positions = [state.held[i].positions for i in range(len(layers))]
        self._keep_masks[cache] = {}
        slots = [int(positions.shape[-1]) for positions in self.kept_positions]
        entries = [count * layer.keys.shape[1] for count, layer in zip(slots, layers)]
        how = self.method.budgets_note(state.plan)
        note = f"{self.method.name:<19} {f'{how}; ' if how else ''}tokens kept per layer {min(slots)}-{max(slots)} of {state.length}"
        return slots, entries, [*notes, note]


class CompressedContext:
    """A context (or a batch of contexts) compressed without its question; answers questions one after another on
    the same cache."""

    def __init__(
        self,
        session: CompressionSession,
        cache: Cache,
        context_lengths: list[int],
        report: CompressionReport | BatchReport,
    ) -> None:
        self.session = session
        self.cache = cache
        self.context_lengths = context_lengths  # each row's own tokens
        self.report = report

    @property
    def keep_masks(self) -> dict[int, torch.Tensor]:
        """The keep masks of the compressed cache's layers (`masked` memory, a batch's padding), held with the cache
        they describe."""
        return self.session.keep_masks(self.cache)

    def generate(
        self, question_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **generate_kwargs
    ) -> object:
        """`model.generate` on the question `question_ids` [B, q] after the compressed context (a batch's questions
        left-padded, with their `attention_mask`); returns what generate returns (sequences start with the
        question). The compressed context is restored afterwards."""
        with self._answering(question_ids, attention_mask):
            return generate_after_context(
                self.session.model,
                self.cache,
                self.context_lengths,
                question_ids,
                attention_mask=attention_mask,
                **generate_kwargs,
            )

    def logits(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The model's logits [B, n, vocab] at every position of `ids` [B, n] after the compressed context, in one
        forward (teacher forcing: the logits at position i are those of the token after ids[:, : i + 1]); a batch's
        rows left-padded, with their `attention_mask`. The compressed context is restored afterwards."""
        with self._answering(ids, attention_mask):
            return logits_after_context(self.session.model, self.cache, self.context_lengths, ids, attention_mask)

    @contextlib.contextmanager
    def _answering(self, ids: torch.Tensor, attention_mask: torch.Tensor | None) -> Iterator[None]:
        """`ids` [B, n] may enter the cache inside the block; the context (and its keep masks) is restored after it."""
        if not self.session.active:
            raise KVRuntimeError(
                "answer questions inside the `with kvruntime.compress(...)` block that made the context"
            )
        if ids.shape[0] != len(self.context_lengths):
            raise KVRuntimeError(
                f"{ids.shape[0]} row(s) of tokens for a context of {len(self.context_lengths)} row(s): give one per row"
            )
        masks = self.keep_masks
        if attention_mask is not None and not bool(attention_mask.all()):
            # The question's padding enters the cache after the context: hidden from attention like the context's.
            heads = self.cache.layers[0].keys.shape[1]
            slots = [layer.keys.shape[2] for layer in self.cache.layers]
            masks = with_appended(masks, slots, heads, attention_mask)
        with self.session.masking(self.cache, masks), restored_after(self.cache):
            yield


def chunk_bounds(length: int, size: int) -> list[tuple[int, int]]:
    """(start, end) of the chunks a prompt of `length` tokens goes in: `size` tokens each but the first, which takes
    the remainder, so that the last chunk holds the prompt's whole window."""
    first = length % size or size
    return [(0, first), *((start, start + size) for start in range(first, length, size))]


def generate_after_context(
    model: nn.Module,
    cache: Cache,
    context_length: int | Sequence[int],
    question_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    **generate_kwargs,
) -> object:
    """`model.generate` on `question_ids` [B, q] after contexts of `context_length` tokens (one, or one per row)
    held (compressed or not) in `cache`: each question takes its original positions after its full context. A
    batch's questions are left-padded, `attention_mask` [B, q] marking their tokens (the padding is not masked here:
    `CompressedContext.generate` hides it). A cache whose layers hold different lengths needs `per_layer_attention`
    around this call."""
    return model.generate(
        input_ids=question_ids,
        **_after_context(model, cache, context_length, question_ids, attention_mask),
        **generate_kwargs,
    )


def logits_after_context(
    model: nn.Module,
    cache: Cache,
    context_length: int | Sequence[int],
    ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The logits [B, n, vocab] at every position of `ids` [B, n] after contexts held in `cache`, in one forward,
    as `generate_after_context` places them (the tokens enter the cache: callers that reuse it restore it)."""
    with torch.no_grad():
        arguments = _after_context(model, cache, context_length, ids, attention_mask)
        return model(input_ids=ids, use_cache=True, logits_to_keep=0, **arguments).logits


def _after_context(
    model: nn.Module,
    cache: Cache,
    context_length: int | Sequence[int],
    ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> dict:
    """The arguments that put `ids` [B, q] after their contexts: the cache, each token's original position after
    its full context, and an attention mask over the context and the (left-padded) ids."""
    batch, length = ids.shape
    device = ids.device
    lengths = [context_length] * batch if isinstance(context_length, int) else list(context_length)
    if attention_mask is None:
        attention_mask = torch.ones(batch, length, dtype=torch.long, device=device)
    offsets = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # a padded question's tokens count from 0 too
    positions = torch.tensor(lengths, device=device)[:, None] + offsets
    context_mask = torch.ones(batch, max(lengths), dtype=attention_mask.dtype, device=device)
    return dict(
        attention_mask=torch.cat([context_mask, attention_mask], dim=1),
        **cache_argument(model, cache),
        **explicit_positions(model, positions),
    )


def explicit_positions(model: nn.Module, positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """The arguments that give tokens their original positions ([n], or [B, n] per row) after a cut cache, whose
    length no longer says how far the sequence has gone: position ids, and cache positions for transformers < 5.3
    (kvpress's range), which derives them from the cache length (one row's: batches there are kvpress's own)."""
    rows = positions if positions.ndim == 2 else positions[None]
    explicit = {"position_ids": rows}
    if hasattr(model, "_get_initial_cache_position"):
        explicit["cache_position"] = rows[0]
    return explicit


@contextlib.contextmanager
def compress(
    model: nn.Module,
    method: str | Method | None = None,
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

    method: a method name or instance; None takes the method and ratio of a `tuned_defaults` artifact among
    `artifacts` (written by `kvcompile tune`), or `kvcompress` when there is none.
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
    files = artifact_files([source for source in artifacts if not isinstance(source, Artifact)])
    read = [source for source in artifacts if isinstance(source, Artifact)]
    loaded = [load_artifact(source, model=model, force=force) for source in [*read, *files]]
    tuned = [a for a in loaded if a.kind == "tuned_defaults"]
    if method is None and tuned:
        defaults = TunedDefaults.from_artifact(tuned[0])
        method, options, ratio = defaults.completed(options, ratio, budget)
        present = {a.path.resolve() for a in loaded if a.path is not None}
        loaded += [
            load_artifact(p, model=model, force=force) for p in defaults.artifact_files if p.resolve() not in present
        ]
    session = CompressionSession(
        model,
        get_method(method or DEFAULT_METHOD, loaded, options),
        ratio,
        budget,
        memory,
        prefill_chunk_size,
        kv_bits,
    )
    with per_layer_attention(model), session.attached():
        yield session
