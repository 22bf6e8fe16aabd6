"""`kvcompile eval`: the suite's prompts through every contestant at every ratio, one prompt at a time (the full
cache first: it is the reference of every fidelity score and of the prefill time), recorded after each prompt.
With a batch size above 1, a kvcompile method answers that many prompts at once (`answer_batch`); the full cache
and kvpress's presses still answer one by one."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from kvcompile.calibration.corpus import load_corpus
from kvcompile.evaluation.contestants import Contestant
from kvcompile.evaluation.metrics import answer_kl, greedy_agreement, next_token_kl
from kvcompile.evaluation.prefill import SharedPrefill, shared_prefill
from kvcompile.evaluation.runner import (
    Answer,
    Scoring,
    answer,
    answer_batch,
    gold_answer,
    scored_tokens,
    split_prompt,
    stop_tokens,
)
from kvcompile.evaluation.settings import SuiteSettings
from kvcompile.evaluation.store import RunStore
from kvcompile.tasks.grid import suite_cells
from kvcompile.tasks.retrieval import TaskPrompt
from kvruntime.models.model_spec import loaded_position_limit

HELD_OUT_BOOK = "moby-dick"  # calibration reads Austen


def evaluate(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    contestants: list[Contestant],
    artifacts: dict[str, list[Path]],
    settings: SuiteSettings,
    store: RunStore,
    batch_size: int = 1,
    shared_prefills: bool = True,
) -> list[dict]:
    limit = loaded_position_limit(model.config)
    prompts = settings.prompts(load_corpus(HELD_OUT_BOOK), tokenizer, limit)
    full = contestants[0]
    # The full cache quantized (`full:kv_bits=N`) removes no entry: it runs once, at ratio 0.
    quantized_full = [(c, 0.0) for c in contestants[1:] if not c.compresses]
    jobs = quantized_full + [(c, r) for r in settings.ratios for c in contestants[1:] if c.compresses]
    # Per prompt, the runs not recorded yet (all of them, or those of methods added to a resumed run).
    left = {i: [(c, r) for c, r in jobs if not store.done(i, c.label, r)] for i in range(len(prompts))}
    todo = run_order([i for i in left if left[i] or not store.done(i, full.label, 0.0)], settings)
    if todo:  # untimed: the first prefill of a process pays for allocations
        reference_answer(model, tokenizer, todo[0], prompts[todo[0]], full, settings)
    done = len(prompts) * (1 + len(jobs)) - sum(1 + len(left[i]) for i in todo)
    bar = tqdm(total=len(prompts) * (1 + len(jobs)), initial=done, desc="kvcompile eval", unit="run")
    for first in range(0, len(todo), batch_size):
        group = todo[first : first + batch_size]
        # The full cache first: its answer is what every method is scored against (run again for methods added to
        # a resumed run: their scores need its logits, which are not stored).
        shared = {
            index: shared_prefill(
                model, split_prompt(tokenizer, prompts[index], settings.question_aware)[0].to(model.device)
            )
            for index in group
            if shared_prefills
        }
        references = {
            index: reference_answer(model, tokenizer, index, prompts[index], full, settings, shared.get(index))
            for index in group
        }
        bar.update(len(group))
        scorings = {index: references[index][1] for index in group}
        answered = batched_answers(model, tokenizer, group, prompts, left, settings, scorings)
        for index in group:
            (reference, scoring, record) = references[index]
            results = run_prompt(
                model, tokenizer, index, prompts[index], left[index], artifacts, settings, (reference, scoring), bar,
                answered[index], shared.get(index),
            )  # fmt: skip
            fresh = [] if store.done(index, full.label, 0.0) else [record]
            store.add([*fresh, *(r for _, r in results)])
    bar.close()
    return store.records


def batched_answers(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    group: list[int],
    prompts: list[TaskPrompt],
    left: dict[int, list[tuple[Contestant, float]]],
    settings: SuiteSettings,
    scorings: dict[int, Scoring],
) -> dict[int, dict[tuple[str, float], Answer]]:
    """The answers of the runs that batch (`Contestant.batches`) and that the group's prompts share, each a batch:
    prompt -> (method label, ratio) -> answer. Runs of a single prompt are left to `run_prompt`."""
    answered: dict[int, dict[tuple[str, float], Answer]] = {index: {} for index in group}
    jobs = {(c.label, r): (c, r) for index in group for c, r in left[index] if c.batches}
    for contestant, ratio in jobs.values():
        indices = [index for index in group if (contestant, ratio) in left[index]]
        if len(indices) < 2:
            continue
        split = [split_prompt(tokenizer, prompts[index], settings.question_aware) for index in indices]
        answers = answer_batch(
            model,
            tokenizer,
            contestant,
            ratio,
            [context.to(model.device) for context, _ in split],
            [question.to(model.device) for _, question in split],
            settings.new_tokens,
            [scorings[index] for index in indices],
        )
        for index, result in zip(indices, answers):
            answered[index][contestant.label, ratio] = result
    return answered


def recorded_score(score: float) -> float | int:
    """A score as records hold it: 0 or 1 as a whole number (as before token F1), a fraction to 4 places."""
    return int(score) if float(score).is_integer() else round(score, 4)


def run_order(indices: list[int], settings: SuiteSettings) -> list[int]:
    """The prompts to run, sample by sample and length by length (each task in turn): a long run stopped early has
    every task and length equally far along, and can be summarised before it is resumed. A user's suite runs in its
    file's order."""
    if settings.suite is not None:
        return sorted(indices)
    cells = suite_cells(settings.tasks, settings.lengths, settings.samples_per_task)
    return sorted(
        indices, key=lambda i: (cells[i][2], settings.lengths.index(cells[i][1]), settings.tasks.index(cells[i][0]))
    )


def reference_answer(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    index: int,
    prompt: TaskPrompt,
    full: Contestant,
    settings: SuiteSettings,
    shared: SharedPrefill | None = None,
) -> tuple[Answer, Scoring, dict]:
    """The full cache's answer (the reference of every score of the prompt), what every method is teacher-forced on
    (its greedy answer, the expected one), and its record (its context from `shared`, when given)."""
    _, question_ids = split_prompt(tokenizer, prompt, settings.question_aware)
    gold = gold_answer(tokenizer, prompt, question_ids)
    ((answer_, record),) = run_prompt(
        model, tokenizer, index, prompt, [(full, 0.0)], {}, settings, (None, Scoring(None, gold)), shared=shared
    )
    return answer_, Scoring(scored_tokens(answer_.tokens, stop_tokens(model)), gold), record


def run_prompt(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    index: int,
    prompt: TaskPrompt,
    jobs: list[tuple[Contestant, float]],
    artifacts: dict[str, list[Path]],
    settings: SuiteSettings,
    reference: tuple[Answer | None, Scoring],
    bar: tqdm | None = None,
    answered: Mapping[tuple[str, float], Answer] = {},
    shared: SharedPrefill | None = None,
) -> list[tuple[Answer, dict]]:
    """Each job's answer and record, scored against the `reference` answer and teacher-forced on its scoring's
    answers (no answer: the job is the reference); jobs `answered` already (in a batch, by (method label, ratio))
    are recorded, not run again; the others cut their context from the `shared` prefill where they can."""
    context_ids, question_ids = (
        ids.to(model.device) for ids in split_prompt(tokenizer, prompt, settings.question_aware)
    )
    full, scoring = reference
    results = []
    for contestant, ratio in jobs:
        # A press that draws at random (Compactor sketches with random projections) draws the same for a prompt
        # whichever runs came before: own or shared prefills, a resumed run, methods added to it.
        torch.manual_seed(settings.seed * 1_000_003 + index)
        result = answered.get((contestant.label, ratio)) or answer(
            model,
            tokenizer,
            contestant,
            ratio,
            context_ids,
            question_ids,
            settings.new_tokens,
            artifacts.get(contestant.label, []),
            scoring,
            shared,
        )
        base = full or result
        results.append(
            (
                result,
                dict(
                    prompt=index,
                    task=prompt.task,
                    length=prompt.length,
                    tokens=int(context_ids.shape[1]),
                    depth=prompt.depth,
                    method=contestant.label,
                    ratio=ratio,
                    correct=recorded_score(prompt.score(result.text)),
                    kl=round(next_token_kl(base.first_logits, result.first_logits), 5),
                    answer_kl=round(answer_kl(base.reference_logits, result.reference_logits), 6),
                    answer_logprob=round(result.gold_logprob, 4),
                    agreement=round(greedy_agreement(base.tokens, result.tokens), 4),
                    prefill_seconds=round(result.prefill_seconds, 4),
                    prefill_vs_full=round(result.prefill_seconds / base.prefill_seconds, 4),
                    peak_mib=None if result.peak_mib is None else round(result.peak_mib, 1),
                    prefill="shared" if result.prefill_shared else "own",
                    cache_kept=round(result.cache_bytes / base.cache_bytes, 4),
                    answer=" ".join(result.text.split())[:120],
                    **({} if prompt.id is None else {"id": prompt.id}),
                ),
            )
        )
        if bar is not None:
            bar.update()
    return results
