"""One `compress(...)` block's session: its hooks into the model and what a prefill goes through. The base model's
forward is wrapped: every forward pass that starts on an empty cache with more than one token is a prefill, which
the session drives (a batch's rows, `rows.py`; a long prompt's chunks, `streaming.py`); the hook of each attention
layer whose cache grows hands the method that layer's last queries, keys and values; the cache is then cut
(`cut.py`), inside the prefill layer by layer where the method's budgets are known in advance, else at its end."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import DynamicCache

from ..errors import KVRuntimeError
from ..math.merging import ReferenceQueries, needs_reference_queries
from ..methods import LayerInputs
from ..methods.resolved import ResolvedRequest
from ..models.layout import model_layout
from ..models.model_spec import check_positions
from ..plumbing.attention import captured_logits, capturing_queries
from ..plumbing.cache_ops import (
    bounded_bytes,
    cache_argument,
    cache_bytes,
    check_growing_layer,
    hooked_cache,
    output_cache,
    own_window_storage,
    own_window_storage_of,
    uncompressed_bytes,
)
from ..plumbing.quantized_cache import KV_BITS, quantize_cache, quantized_layer
from ..plumbing.recording import RECORDED_QUERIES, PrefillRecording, check_replayable
from ..plumbing.window import hooked_input, hooked_window_queries
from ..report import BatchReport, CompressionReport
from ..requests.request import Request
from .answering import CompressedContext
from .appended import appended_inputs, narrow_window, prompt_part, widen_window, without_appended
from .cut import cut_cache, cut_layer, method_prefill
from .keep_masks import KeepMasks
from .rows import prefill_rows
from .state import Compressed, PrefillState, chunk_bounds
from .streaming import feed_earlier_chunks

# Attribute a model carries while a compression block is attached to it (blocks do not nest).
_ACTIVE_SESSION = "_kvruntime_session"


class CompressionSession:
    """Hooks and state of one `compress(...)` block. `reports` lists one report per compressed prefill."""

    def __init__(self, model: nn.Module, resolved: ResolvedRequest, request: Request) -> None:
        """`request`: the one of `resolved`'s requests this block serves (the serving checks ran on it there)."""
        # The layers every method scores and cuts (a method's layer i is the i-th), and the sliding-window ones,
        # which the model bounds itself and which are left to it.
        self.layout = model_layout(model)
        self._attention = self.layout.cut_modules
        self.kv_bits = resolved.kv_bits  # the kept entries are quantized to this many bits once cut
        self.layout.check_kv_bits(self.kv_bits)
        if self.kv_bits is not None:
            quantized_layer(self.kv_bits)  # refuses a transformers without that layer before any prefill
        self.model = model
        self.method = resolved.method
        self.request = request
        self.prefill_chunk_size = resolved.prefill_chunk_size
        self.reports: list[CompressionReport] = []  # one per compressed prompt (per row of a batch)
        self.batch_reports: list[BatchReport] = []  # one per compressed batch
        # Original positions of the entries each layer kept in the latest compression, [B, Hkv, slots] per layer.
        self.kept_positions: list[torch.Tensor] = []
        self._position = {module: position for position, module in enumerate(self._attention)}
        # The prefill going through the model now (set and cleared by `_feeding`): what the attention hooks feed.
        self._prefill: PrefillState | None = None
        self.keep_masks = KeepMasks()  # of the caches it compressed
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._base_forward: Callable[..., object] | None = None  # the base model's own forward, while attached

    @property
    def ratio(self) -> float | None:
        return self.request.ratio

    @property
    def budget(self) -> int | None:
        return self.request.budget

    @property
    def memory(self) -> str:
        return self.request.memory

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
        arguments = dict(input_ids=input_ids, attention_mask=attention_mask, **cache_argument(self.model, cache))
        with torch.no_grad():
            _, compressed = self.compressed_forward(self._base_forward, **arguments, use_cache=True)
        if compressed is None:
            raise KVRuntimeError("the context was not compressed")
        rows, length = input_ids.shape
        lengths = [length] * rows if attention_mask is None else attention_mask.sum(1).tolist()
        return CompressedContext(self, cache, lengths, compressed.report, compressed.kept_positions)

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
        streamed_in = self.prefill_chunk_size if self.streams(recording.length) else None
        check_replayable(recording, streamed_in, self.method.window)
        state = self._new_prefill(recording.input_ids)
        with torch.no_grad(), self._feeding(state):
            cache, output = recording.replay(self.model, self._after_attention)
        compressed = self._finish(state, output)
        self.kept_positions = compressed.kept_positions
        return CompressedContext(self, cache, [recording.length], compressed.report, compressed.kept_positions)

    # -- hooks ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def attached(self) -> Iterator[CompressionSession]:
        base = self.model.base_model
        if getattr(self.model, _ACTIVE_SESSION, None) is not None:
            raise KVRuntimeError("this model is already inside a `kvruntime.compress(...)` block: blocks do not nest")
        setattr(self.model, _ACTIVE_SESSION, self)
        # The base model's forward, wrapped while attached: a prefill goes through `compressed_forward`, which
        # drives its rows and chunks; every other forward (decoding, a second pass) goes through unchanged.
        own_forward = base.__dict__.get("forward")  # an instance's own forward (accelerate's hooks set one)
        self._base_forward = base.forward
        base.forward = functools.wraps(self._base_forward)(functools.partial(self._forward, self._base_forward))
        for module in self._attention:
            self._handles.append(module.register_forward_hook(self._after_attention, with_kwargs=True))
            self._handles.append(module.register_forward_pre_hook(self._inject_keep_mask, with_kwargs=True))
        for module in self.layout.sliding_modules:
            self._handles.append(module.register_forward_pre_hook(self._before_window_attention, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._after_window_attention, with_kwargs=True))
        try:
            queries = self.method.appended_queries  # fed inside a prompt's prefill (`appended.py`)
            with capturing_queries(self._attention, self.method.window + (0 if queries is None else len(queries))):
                yield self
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            if own_forward is None:
                del base.forward
            else:
                base.forward = own_forward
            self._base_forward = None
            delattr(self.model, _ACTIVE_SESSION)

    def _forward(self, forward: Callable[..., object], *args: object, **kwargs: object) -> object:
        """The base model's forward while attached (`compressed_forward`, its output alone)."""
        return self.compressed_forward(forward, *args, **kwargs)[0]

    def compressed_forward(
        self, forward: Callable[..., object], *args: object, **kwargs: object
    ) -> tuple[object, Compressed | None]:
        """The base model's `forward` on these arguments, a prefill (an empty cache, two tokens or more) compressed
        (a batch or a padded prompt row by row, a long prompt in chunks): the output, and what the prefill kept
        and its report (None for a forward that is not a prefill)."""
        if args:  # the input ids given by position: pass them on by name, as the rows and chunks are
            kwargs, args = {**kwargs, "input_ids": args[0]}, args[1:]
        tokens_key = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
        tokens = kwargs[tokens_key]
        cache = hooked_cache(kwargs)
        batch, length = tokens.shape[:2]
        starts_empty = cache is None or cache.get_seq_length() == 0
        if starts_empty and cache is not None:  # a new sequence: an earlier prompt's keep masks do not apply to it
            self.keep_masks.drop(cache)
        if not starts_empty or length < 2 or kwargs.get("use_cache") is False:
            return forward(*args, **kwargs), None
        mask = kwargs.get("attention_mask")
        if batch != 1 or (isinstance(mask, torch.Tensor) and mask.ndim == 2 and not bool(mask.all())):
            output, compressed = prefill_rows(self, forward, kwargs, tokens_key, cache)
        else:
            check_positions(length, self.layout.positions, f"a prompt of {length} tokens")
            state = self._new_prefill(tokens)
            with self._feeding(state):
                if self.streams(length) and cache is not None:
                    bounds = chunk_bounds(length, self.prefill_chunk_size)
                    kwargs = feed_earlier_chunks(self.model, forward, kwargs, tokens_key, bounds, state)
                else:
                    kwargs = appended_inputs(self.model, kwargs, tokens_key, state)
                output = forward(*args, **kwargs)
                output = without_appended(output, length) if state.appended else output
            compressed = self._finish(state, output)
        if compressed is not None:
            self.kept_positions = compressed.kept_positions
        return output, compressed

    @contextlib.contextmanager
    def _feeding(self, state: PrefillState) -> Iterator[None]:
        """The attention hooks feed `state` inside the block, and nothing after it (an error included)."""
        self._prefill = state
        try:
            yield
        finally:
            self._prefill = None

    def _new_prefill(self, tokens: torch.Tensor) -> PrefillState:
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
        state = PrefillState(length=length, started=time.perf_counter(), input_ids=ids, plan=plan)
        if self.method.rescores_whole_prompt(plan):  # held whole, its queries fed after it
            state.lookahead = self.method.appended_queries
        if self.method.budgets_known_in_advance and (self.streams(length) or state.lookahead is None):
            state.budgets = self.method.layer_budgets(len(self._attention), plan)
        return state

    def _after_attention(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        state = self._prefill
        if state is None:
            return
        started = time.perf_counter()
        with torch.no_grad():
            index = self._position[module]
            queries, cache_layer, _ = hooked_window_queries(module, args, kwargs, self.method.window + state.appended)
            hidden_states = hooked_input(args, kwargs)
            if state.appended:
                queries, hidden_states = prompt_part(state, index, module, queries, cache_layer, hidden_states)
            layer = LayerInputs(
                index,
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
                if needs_reference_queries(self.method.merge):  # read by the cut once the prefill ends
                    state.references[layer.index] = ReferenceQueries(layer.queries, layer.logits)
            else:
                check_growing_layer(cache_layer, module.layer_idx)
                cut_layer(self.method, cache_layer, layer, state)
        state.scoring_seconds += time.perf_counter() - started

    def _before_window_attention(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._prefill is not None and self._prefill.appended:
            widen_window(hooked_cache(kwargs).layers[module.layer_idx], self._prefill.appended)

    def _after_window_attention(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        """A sliding-window layer in a prefill lets the prompt's keys and values go once it has attended: the cache
        held stays its window, not the prompt (nor the appended positions)."""
        if self._prefill is not None:
            layer = hooked_cache(kwargs).layers[module.layer_idx]
            if self._prefill.appended:
                narrow_window(layer, self._prefill.appended)
            own_window_storage_of(layer)

    def _inject_keep_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        return None if self._prefill is not None else self.keep_masks.injected(module, args, kwargs)

    # -- cutting -------------------------------------------------------------------------------------------
    def _finish(self, state: PrefillState, output: object) -> Compressed | None:
        """Cut the cache of a prefill that went through (`output`'s) and report it; None when it holds no cache."""
        cache = output_cache(output)
        if cache is None:
            return None
        started = time.perf_counter()
        peak = max(cache_bytes(cache), state.peak_bytes)
        with torch.no_grad():  # a prefill run outside no_grad must not build graphs through the selection
            prefill = method_prefill(self.model, self.method.name, cache, state, output)
            cut = cut_cache(self.method, self._attention, cache, state, prefill, self.memory)
            self.keep_masks.set(cache, cut.masks)
            own_window_storage(cache)
            num_kv_heads, full_bytes = cache.layers[0].keys.shape[1], uncompressed_bytes(cache, state.length)
            notes = cut.notes
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
            slots_per_layer=cut.slots,
            entries_per_layer=cut.entries,
            bytes_before=full_bytes,
            bytes_after=cache_bytes(cache),
            peak_bytes=peak,
            prefill_seconds=started - state.started - state.scoring_seconds,
            compress_seconds=state.scoring_seconds + ended - started,
            cut=state.path(),
            notes=notes,
            layers=list(self.layout.cut_layers),
            bounded_layers=list(self.layout.sliding_layers),
            bounded_bytes=bounded_bytes(cache),
        )
        self.reports.append(report)
        return Compressed(report, cut.kept_positions)
