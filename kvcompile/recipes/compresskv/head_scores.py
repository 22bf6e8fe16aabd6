"""Retrieval-head scores, pure functions over one probe's decoding-time attention rows.

attention: [steps, layers, query heads, prompt length], the attention of the query that produced each generated
token (step t produced token generated[t]) over the prompt's keys.
"""

from __future__ import annotations

import re
from collections import Counter

import torch


def rouge1_recall(answer: str, generated: str) -> float:
    """Share of the answer's words (with multiplicity) found in the generated text."""
    expected = Counter(re.findall(r"\w+", answer.lower()))
    found = Counter(re.findall(r"\w+", generated.lower()))
    total = sum(expected.values())
    return sum(min(n, found[w]) for w, n in expected.items()) / total if total else 0.0


def semantic_retrieval_score(
    attention: torch.Tensor, prompt_ids: list[int], span: list[int], generated: list[int]
) -> torch.Tensor:
    """CompressKV's SRH score of one probe: at each step whose token occurs in the answer span, the attention
    mass on the WHOLE span, once per occurrence. Returns [layers, query heads]."""
    span_ids = [prompt_ids[i] for i in span]
    mass = attention[..., span].sum(dim=-1)  # [steps, L, Hq]
    occurrences = torch.tensor([span_ids.count(token) for token in generated], dtype=mass.dtype)
    return (occurrences[:, None, None] * mass).sum(dim=0)


def copy_retrieval_score(
    attention: torch.Tensor, prompt_ids: list[int], span: list[int], generated: list[int]
) -> torch.Tensor:
    """The classic retrieval-head score (Wu et al., 2024): +1/|span| each step the most attended key is in the
    span and holds the very token being generated (copy-paste). Returns [layers, query heads]."""
    top = attention.argmax(dim=-1)  # [steps, L, Hq]
    ids = torch.tensor(prompt_ids)
    in_span = torch.zeros(len(prompt_ids), dtype=torch.bool)
    in_span[span] = True
    copied = in_span[top] & (ids[top] == torch.tensor(generated)[:, None, None])
    return copied.sum(dim=0).to(attention.dtype) / len(span)
