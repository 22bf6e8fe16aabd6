"""One prompt through one contestant: prefill (timed, peak memory measured), compression, then the answer over the
compressed context through the same greedy decoding path for every contestant.

Question-agnostic (default): the context is compressed alone and the question is asked afterwards, at its original
positions. Question-aware: everything but the prompt's last token is compressed, so the question is in the
observation window of the window-scored methods."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedTokenizerBase

import kvruntime
from kvcompile.evaluation.contestants import Contestant
from kvcompile.evaluation.measure import PeakMemory
from kvcompile.evaluation.metrics import AGREEMENT_TOKENS
from kvcompile.tasks.retrieval import TaskPrompt
from kvruntime import generate_after_context, logits_after_context
from kvruntime.attention import KEEP_MASK_KEYWORD, per_layer_attention
from kvruntime.batch_rows import left_pad
from kvruntime.cache_ops import attention_modules, cache_argument, cache_bytes, restored_after
from kvruntime.quantized_cache import quantize_cache
from kvruntime.recording import PrefillRecording, recorded_prefill
from kvruntime.serving import method_facts


@dataclasses.dataclass
class Answer:
    text: str
    tokens: list[int]
    first_logits: torch.Tensor  # [vocab] logits of the first answer token
    prefill_seconds: float  # prefill + compression of the context
    peak_mib: float | None
    cache_bytes: int  # KV bytes held after compression
    # Teacher forced on the full cache's answer (`reference_tokens`): the logits [n, vocab] predicting each of its
    # tokens, for the KL from the full cache at every answer token, not only the first.
    reference_logits: torch.Tensor
    gold_logprob: float  # log-probability of the expected answer (`gold_answer`) after the question
    prefill_shared: bool = False  # its context was cut from the prompt's shared prefill (`SharedPrefill`)


@dataclasses.dataclass(frozen=True)
class Scoring:
    """The answers every contestant is teacher-forced on, for one prompt: the full cache's (None: the contestant is
    the full cache, which is scored on its own greedy answer) and the expected one."""

    reference: list[int] | None
    gold: list[int]


def gold_answer(tokenizer: PreTrainedTokenizerBase, prompt: TaskPrompt, question_ids: torch.Tensor) -> list[int]:
    """The expected answer's text (`TaskPrompt.gold_text`, after a space where the question ends in a word, as an
    answer cue does): whose log-probability is a continuous measure of being right."""
    question = tokenizer.decode(question_ids[0])
    text = ("" if question[-1:].isspace() else " ") + prompt.gold_text
    return tokenizer(text, add_special_tokens=False).input_ids


def scored_tokens(tokens: list[int], stops: set[int]) -> list[int]:
    """The part of a greedy answer the fidelity scores read: up to its first stop token, at most
    AGREEMENT_TOKENS."""
    return until_stop(tokens, stops)[:AGREEMENT_TOKENS]


def stop_tokens(model: nn.Module) -> set[int]:
    stops = model.generation_config.eos_token_id
    return {stops} if isinstance(stops, int) else set(stops or ())


def split_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: TaskPrompt, question_aware: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(context ids, question ids): the first part is compressed, the second asked afterwards."""
    if question_aware:
        ids = tokenizer(prompt.prompt, return_tensors="pt", add_special_tokens=False).input_ids
        return ids[:, :-1], ids[:, -1:]

    def encode(text: str) -> torch.Tensor:
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids

    return encode(prompt.prompt[: prompt.question_start]), encode(prompt.prompt[prompt.question_start :])


@dataclasses.dataclass
class Prefill:
    """A context prefilled (and compressed) by a contestant, ready to answer."""

    seconds: float  # prefill + compression
    peak_mib: float | None
    cache_bytes: int  # KV bytes held after compression
    generate: Callable[..., object]  # (question_ids, **generate kwargs) -> generate's output
    logits: Callable[..., torch.Tensor]  # (ids [B, n], attention_mask=None) -> logits [B, n, vocab], teacher forced
    shared: bool = False  # cut from a shared prefill (`seconds` adds its forward; peak memory not measured)


def compressing(
    model: nn.Module, contestant: Contestant, ratio: float, artifacts: list[Path]
) -> contextlib.AbstractContextManager:
    """`kvruntime.compress` as a kvcompile contestant asks for it (in the memory mode its options need, if any)."""
    return kvruntime.compress(
        model,
        contestant.method,
        ratio=ratio,
        memory=method_facts(contestant.method, contestant.options).memory or "padded",
        artifacts=artifacts,
        options=contestant.options,
        prefill_chunk_size=contestant.prefill_chunk_size,
        kv_bits=contestant.kv_bits,
    )


def greedy(new_tokens: int, tokenizer: PreTrainedTokenizerBase) -> dict:
    """The decoding every contestant answers with: greedy, with the logits of every step."""
    return dict(
        max_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=tokenizer.eos_token_id,
    )


@dataclasses.dataclass
class SharedPrefill:
    """A prompt's context prefilled once with the full cache and recorded: the full cache answers from it, and every
    contestant that can cuts its copy from it (`PrefillRecording.replay`) instead of a prefill of its own."""

    recording: PrefillRecording
    seconds: float


def shared_prefill(model: nn.Module, context_ids: torch.Tensor) -> SharedPrefill:
    with PeakMemory(context_ids.device) as timer:
        started = time.perf_counter()
        recording = recorded_prefill(model, context_ids)
        return SharedPrefill(recording, timer.seconds_since(started))


@contextlib.contextmanager
def prefilled(
    model: nn.Module,
    contestant: Contestant,
    ratio: float,
    context_ids: torch.Tensor,
    artifacts: list[Path],
    shared: SharedPrefill | None = None,
) -> Iterator[Prefill]:
    """Prefill and compress the context (timed, peak memory measured); answer inside the block. From a `shared`
    prefill where the contestant can be replayed on it: timed as the shared forward plus the contestant's hooks,
    peak memory not measured."""
    if contestant.kind == "kvcompile":
        with compressing(model, contestant, ratio, artifacts) as session:
            replayed = shared is not None and not session.streams(context_ids.shape[1])
            with PeakMemory(context_ids.device) as peak:
                started = time.perf_counter()
                context = session.compress_recording(shared.recording) if replayed else session.prefill(context_ids)
                seconds = peak.seconds_since(started) + (shared.seconds if replayed else 0.0)
            yield Prefill(
                seconds,
                None if replayed else peak.mib,
                context.report.bytes_after,
                context.generate,
                context.logits,
                replayed,
            )
        return
    press = contestant.press(ratio, model, artifacts) if contestant.kind == "kvpress" else None
    replayed = shared is not None and (press is None or replays(press))
    with PeakMemory(context_ids.device) as peak:
        started = time.perf_counter()
        if replayed:
            cache = replayed_press(model, press, shared.recording)
        else:
            cache = DynamicCache(config=model.config)
            with torch.no_grad(), press(model) if press is not None else contextlib.nullcontext():
                model(input_ids=context_ids, **cache_argument(model, cache), use_cache=True, logits_to_keep=1)
        seconds = peak.seconds_since(started) + (shared.seconds if replayed else 0.0)
    masks = press_keep_masks(model, cache, context_ids.shape[1])
    if contestant.kv_bits is not None:  # the full cache quantized (`full:kv_bits=N`)
        if replayed:  # the recording's cache is shared by the prompt's other runs: quantize a list of its layers
            cache = copy.copy(cache)
            cache.layers = list(cache.layers)
        quantize_cache(cache, contestant.kv_bits)

    @contextlib.contextmanager
    def answering() -> Iterator[None]:
        # Presses may leave layers of different lengths (per-layer attention) or hide entries (keep masks); what
        # a question or an answer adds to the cache is gone after it, so that the context answers again.
        with per_layer_attention(model), keep_mask_hooks(model, masks), restored_after(cache):
            yield

    def generate(question_ids: torch.Tensor, **kwargs) -> object:
        with answering():
            return generate_after_context(model, cache, context_ids.shape[1], question_ids, **kwargs)

    def logits(ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        with answering():
            return logits_after_context(model, cache, context_ids.shape[1], ids, attention_mask)

    yield Prefill(seconds, None if replayed else peak.mib, held_bytes(cache, masks), generate, logits, replayed)


def replays(press: object) -> bool:
    """Whether a kvpress press does all its work in the forward hook kvpress's base press registers (then it can
    run on a recorded prefill); presses that add passes (KVzip) or hooks of their own cannot."""
    from kvpress.presses.base_press import BasePress

    kind = type(press)
    return kind.__call__ is BasePress.__call__ and kind.forward_hook is BasePress.forward_hook


def replayed_press(model: nn.Module, press: object | None, recording: PrefillRecording) -> DynamicCache:
    """The cache a press (None: no compression) leaves after the recorded prefill, its hook run on each layer's
    recorded call."""
    if press is None:
        return recording.cache
    press.post_init_from_model(model)
    with torch.no_grad():
        cache, _ = recording.replay(model, press.forward_hook)
    return cache


def press_keep_masks(model: nn.Module, cache: DynamicCache, context_length: int) -> dict[int, torch.Tensor]:
    """The entries a masking press hides, as keep masks [1, Hkv, N] per layer. kvpress's KVzip (and AdaKV-style
    presses) do not remove entries: they leave `masked_key_indices` (batch, head, position) on each attention module
    for kvpress's attention patch, which the per-layer attention here does not go through. The indices are taken
    off the modules (so that no later run sees them), and what a scoring pass left beyond the context is freed."""
    for layer in cache.layers:
        # KVzip's reconstruction pass appends the copy, then cuts it off with a view that holds on to its storage.
        if layer.keys.shape[-2] > context_length or layer.keys.untyped_storage().nbytes() > layer.keys.nbytes:
            layer.keys = layer.keys[..., :context_length, :].clone()
            layer.values = layer.values[..., :context_length, :].clone()
    masks = {}
    for module in attention_modules(model):
        indices = getattr(module, "masked_key_indices", None)
        if indices is None:
            continue
        del module.masked_key_indices
        layer = cache.layers[module.layer_idx]
        mask = torch.ones(layer.keys.shape[:3], dtype=torch.bool, device=layer.keys.device)
        mask[indices] = False
        masks[module.layer_idx] = mask
    return masks


@contextlib.contextmanager
def keep_mask_hooks(model: nn.Module, masks: dict[int, torch.Tensor]) -> Iterator[None]:
    """Pass each layer's keep mask to the per-layer attention while the block runs."""

    def inject(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, KEEP_MASK_KEYWORD: masks[module.layer_idx]}

    handles = [
        module.register_forward_pre_hook(inject, with_kwargs=True)
        for module in attention_modules(model)
        if module.layer_idx in masks
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def held_bytes(cache: DynamicCache, masks: dict[int, torch.Tensor]) -> int:
    """KV bytes held, counting a masked layer as a dense store of its heads' largest kept count (what the engine's
    `padded` memory holds for per-head counts): hidden entries are not counted as freed beyond that."""
    hidden = 0
    for index, mask in masks.items():
        layer, length = cache.layers[index], mask.shape[-1]
        unused_slots = length - int(mask.sum(dim=-1).max())
        hidden += (layer.keys.nbytes + layer.values.nbytes) * unused_slots // length
    return cache_bytes(cache) - hidden


def answer(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    contestant: Contestant,
    ratio: float,
    context_ids: torch.Tensor,
    question_ids: torch.Tensor,
    new_tokens: int,
    artifacts: list[Path],
    scoring: Scoring,
    shared: SharedPrefill | None = None,
) -> Answer:
    """The contestant's greedy answer to the question over its compressed context, with the prefill's measures and
    the answers of `scoring` teacher-forced over the same context (its context cut from `shared` where it can)."""
    with prefilled(model, contestant, ratio, context_ids, artifacts, shared) as context:
        output = context.generate(question_ids, **greedy(new_tokens, tokenizer))
        tokens = output.sequences[0, question_ids.shape[1] :].tolist()
        reference = scoring.reference or scored_tokens(tokens, stop_tokens(model))
        forced = [forced_logits(context.logits, [question_ids[0]], [answer]) for answer in (reference, scoring.gold)]
    return Answer(
        text=tokenizer.decode(tokens, skip_special_tokens=True),
        tokens=tokens,
        first_logits=output.logits[0][0].float().cpu(),
        prefill_seconds=context.seconds,
        peak_mib=context.peak_mib,
        cache_bytes=context.cache_bytes,
        reference_logits=forced[0][0],
        gold_logprob=answer_logprob(forced[1][0], scoring.gold),
        prefill_shared=context.shared,
    )


def forced_logits(
    logits: Callable[..., torch.Tensor], questions: list[torch.Tensor], answers: list[list[int]]
) -> list[torch.Tensor]:
    """Per row, the logits [n, vocab] that predict each of its answer's n tokens after its question (teacher
    forcing, all rows in one forward: question and answer but its last token, left-padded)."""
    device = questions[0].device
    rows = [torch.cat([question, torch.tensor(answer[:-1], dtype=question.dtype, device=device)])
            for question, answer in zip(questions, answers)]  # fmt: skip
    ids, mask = left_pad(rows, 0)
    out = logits(ids, attention_mask=mask if len(rows) > 1 else None)
    return [out[row, out.shape[1] - len(answer) :].float().cpu() for row, answer in enumerate(answers)]


def answer_logprob(logits: torch.Tensor, tokens: list[int]) -> float:
    """The log-probability (nats) of `tokens` under the teacher-forced `logits` [n, vocab] that predict them."""
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    return float(logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].sum())


def answer_batch(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    contestant: Contestant,
    ratio: float,
    contexts: list[torch.Tensor],
    questions: list[torch.Tensor],
    new_tokens: int,
    artifacts: list[Path],
    scorings: list[Scoring],
) -> list[Answer]:
    """`answer` for several prompts at once (a kvcompile method): the contexts [1, n] compressed as one batch (each
    row as it would be alone) and the questions [1, q] answered together. A row's prefill time and bytes held are
    its own (the engine prefills row by row); its peak memory is not measured (the batch's is shared). The
    `scorings` name each row's full-cache answer."""
    context_ids, context_mask = left_pad([ids[0] for ids in contexts], tokenizer.eos_token_id)
    question_ids, question_mask = left_pad([ids[0] for ids in questions], tokenizer.eos_token_id)
    rows = [ids[0] for ids in questions]
    with compressing(model, contestant, ratio, artifacts) as session:
        context = session.prefill(context_ids, attention_mask=context_mask)
        output = context.generate(question_ids, attention_mask=question_mask, **greedy(new_tokens, tokenizer))
        references = forced_logits(context.logits, rows, [scoring.reference for scoring in scorings])
        golds = forced_logits(context.logits, rows, [scoring.gold for scoring in scorings])
    stops, answers = stop_tokens(model), []
    for row, report in enumerate(context.report.rows):
        tokens = until_stop(output.sequences[row, question_ids.shape[1] :].tolist(), stops)
        answers.append(
            Answer(
                text=tokenizer.decode(tokens, skip_special_tokens=True),
                tokens=tokens,
                first_logits=output.logits[0][row].float().cpu(),
                prefill_seconds=report.prefill_seconds + report.compress_seconds,
                peak_mib=None,
                cache_bytes=report.bytes_after,
                reference_logits=references[row],
                gold_logprob=answer_logprob(golds[row], scorings[row].gold),
            )
        )
    return answers


def until_stop(tokens: list[int], stops: set[int]) -> list[int]:
    """A batch row's generated tokens as generating it alone gives them: up to its first stop token (included);
    generate fills a finished row with padding until the whole batch has finished."""
    for index, token in enumerate(tokens):
        if token in stops:
            return tokens[: index + 1]
    return tokens
