"""One prompt through one contestant: prefill (timed, peak memory measured), compression, then the answer over the
compressed context through the same greedy decoding path for every contestant.

Question-agnostic (default): the context is compressed alone and the question is asked afterwards, at its original
positions. Question-aware: everything but the prompt's last token is compressed, so the question is in the
observation window of the window-scored methods."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from kvcompile.evaluation.contestants import Contestant, RuntimeMethod
from kvcompile.evaluation.metrics import AGREEMENT_TOKENS
from kvcompile.evaluation.prefill import SharedPrefill
from kvcompile.prompt_format import prompt_ids
from kvcompile.tasks.retrieval import TaskPrompt
from kvruntime.plumbing.batch_rows import left_pad


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

    def encode(text: str, whole: bool = False) -> torch.Tensor:
        return torch.tensor([prompt_ids(tokenizer, text, whole)])  # a whole prompt: Gemma's <bos> first

    if question_aware:
        ids = encode(prompt.prompt, whole=True)
        return ids[:, :-1], ids[:, -1:]
    return encode(prompt.prompt[: prompt.question_start], whole=True), encode(prompt.prompt[prompt.question_start :])


def greedy(new_tokens: int, tokenizer: PreTrainedTokenizerBase) -> dict:
    """The decoding every contestant answers with: greedy, with the logits of every step."""
    return dict(
        max_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=tokenizer.eos_token_id,
    )


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
    with contestant.prefilled(model, ratio, context_ids, artifacts, shared) as answerable:
        output = answerable.generate(question_ids, **greedy(new_tokens, tokenizer))
        tokens = output.sequences[0, question_ids.shape[1] :].tolist()
        reference = scoring.reference or scored_tokens(tokens, stop_tokens(model))
        forced = [forced_logits(answerable.logits, [question_ids[0]], [answer]) for answer in (reference, scoring.gold)]
    return Answer(
        text=tokenizer.decode(tokens, skip_special_tokens=True),
        tokens=tokens,
        first_logits=output.logits[0][0].float().cpu(),
        prefill_seconds=answerable.seconds,
        peak_mib=answerable.peak_mib,
        cache_bytes=answerable.cache_bytes,
        reference_logits=forced[0][0],
        gold_logprob=answer_logprob(forced[1][0], scoring.gold),
        prefill_shared=answerable.shared,
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
    contestant: RuntimeMethod,
    ratio: float,
    contexts: list[torch.Tensor],
    questions: list[torch.Tensor],
    new_tokens: int,
    scorings: list[Scoring],
) -> list[Answer]:
    """`answer` for several prompts at once (a kvcompile method): the contexts [1, n] compressed as one batch (each
    row as it would be alone) and the questions [1, q] answered together. A row's prefill time and bytes held are
    its own (the engine prefills row by row); its peak memory is not measured (the batch's is shared). The
    `scorings` name each row's full-cache answer."""
    context_ids, context_mask = left_pad([ids[0] for ids in contexts], tokenizer.eos_token_id)
    question_ids, question_mask = left_pad([ids[0] for ids in questions], tokenizer.eos_token_id)
    rows = [ids[0] for ids in questions]
    with contestant.compressing(model, ratio) as session:
        compressed = session.prefill(context_ids, attention_mask=context_mask)
        output = compressed.generate(question_ids, attention_mask=question_mask, **greedy(new_tokens, tokenizer))
        references = forced_logits(compressed.logits, rows, [scoring.reference for scoring in scorings])
        golds = forced_logits(compressed.logits, rows, [scoring.gold for scoring in scorings])
    stops, answers = stop_tokens(model), []
    for row, report in enumerate(compressed.report.rows):
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
