"""What the coverage studies share (compilerkv's, kvcompose's, distilled's): held-out retrieval prompts with the
answer's token positions, the command line of the ratio sweeps, and the share of the answer a compression kept."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator, Mapping

import torch
from tqdm.auto import tqdm

import kvruntime
from kvcompile.calibration.corpus import load_corpus
from kvcompile.tasks.retrieval import TASKS, TaskPrompt, retrieval_prompt


def answer_positions(tokenizer, text: str, answer: str) -> list[int]:
    """Token positions of the answer's first occurrence in the prompt."""
    start = text.lower().index(answer.lower())
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [i for i, (a, b) in enumerate(encoded.offset_mapping) if a < start + len(answer) and b > start]


def ratio_coverage_arguments(description: str, out: str) -> argparse.Namespace:
    """The command line of the coverage studies that sweep ratios (kvcompose's, distilled's); `ratios` parsed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--ratios", default="0.5,0.75,0.9")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--out", default=out)
    args = parser.parse_args()
    args.ratios = [float(x) for x in args.ratios.split(",")]
    return args


def question_agnostic_prompts(tokenizer, depths: str, length: int) -> list[tuple[TaskPrompt, torch.Tensor, list[int]]]:
    """The held-out retrieval prompts of the coverage studies (Moby-Dick haystack; each task at each depth): the
    prompt, its context's token ids without the question, and the answer's token positions in it."""
    haystack = load_corpus("moby-dick")
    found = []
    for index, depth in enumerate(depths.split(",")):
        for task in TASKS:
            prompt = retrieval_prompt(task, haystack, tokenizer, length, float(depth), seed=index)
            context = prompt.prompt[: prompt.question_start]
            ids = tokenizer(context, return_tensors="pt", add_special_tokens=False).input_ids
            found.append((prompt, ids, answer_positions(tokenizer, context, prompt.expected[0])))
    return found


def coverage(kept_positions: list[torch.Tensor], span: list[int]) -> float:
    wanted = torch.tensor(span)
    shares = [
        float(torch.isin(wanted, kept[0, head]).float().mean())
        for kept in kept_positions
        for head in range(kept.shape[1])
    ]
    return statistics.mean(shares)


def coverage_sessions(
    model: torch.nn.Module, tokenizer, args: argparse.Namespace, methods: Mapping[str, object]
) -> Iterator[tuple[TaskPrompt, float, str, kvruntime.CompressionSession, list[int]]]:
    """Each held-out prompt's context compressed by each method at each of `args.ratios`: (prompt, ratio, method
    label, the session after its prefill, the answer's positions)."""
    prompts = question_agnostic_prompts(tokenizer, args.depths, args.length)
    for prompt, ids, span in tqdm(prompts, desc="coverage", unit="prompt"):
        for ratio in args.ratios:
            for label, method in methods.items():
                with kvruntime.compress(model, method, ratio=ratio) as session:
                    session.prefill(ids)
                yield prompt, ratio, label, session, span
