"""`kvcompile heads`: Semantic Retrieval Head scores (and the classic retrieval-head scores) from needle probes."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from kvruntime.artifact import Artifact
from kvruntime.errors import KVRuntimeError
from kvruntime.fingerprint import model_fingerprint

from .attention_capture import generate_with_attention_rows
from .checkpoint import load_checkpoint, save_checkpoint
from .corpus import Corpus
from .head_scores import copy_retrieval_score, rouge1_recall, semantic_retrieval_score
from .provenance import provenance
from .tasks.needles import CALIBRATION_NEEDLES, answer_token_positions, probe_grid

SUCCESS_RECALL = 0.5  # a probe counts when the answer's ROUGE-1 recall is above this


def compile_head_scores(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    corpus: Corpus,
    lengths: list[int],
    depths: list[float],
    seed: int,
    out: Path,
    chat: bool = True,
    resume: bool = False,
    checkpoint_every: int = 8,
) -> Artifact:
    fingerprint = model_fingerprint(model)
    probes = probe_grid(corpus, tokenizer, lengths, depths, seed, chat)
    settings = {
        "model": fingerprint.to_dict(),
        "corpus_sha256": corpus.sha256,
        "lengths": lengths,
        "depths": depths,
        "seed": seed,
        "needles": len(CALIBRATION_NEEDLES),
        "chat": chat,
    }
    shape = (fingerprint.num_layers, fingerprint.num_query_heads)
    sums = {"srh": torch.zeros(shape, dtype=torch.float64), "copy": torch.zeros(shape, dtype=torch.float64)}
    recalls = torch.full((len(probes),), -1.0)
    start = 0
    saved = load_checkpoint(out, settings) if resume else None
    if saved is not None:
        tensors, progress = saved
        sums = {"srh": tensors["srh"], "copy": tensors["copy"]}
        recalls, start = tensors["recalls"], progress["next_probe"]
    bar = tqdm(total=len(probes), initial=start, desc="needle probes", unit="probe")
    for index in range(start, len(probes)):
        probe = probes[index]
        prompt_ids, span = answer_token_positions(tokenizer, probe)
        # Small models often restate the whole needle sentence before (or as) the answer: leave room for it.
        sentence_tokens = len(tokenizer(CALIBRATION_NEEDLES[probe.needle].sentence, add_special_tokens=False).input_ids)
        rows, generated = generate_with_attention_rows(
            model, torch.tensor([prompt_ids]), sentence_tokens + 8, tokenizer.eos_token_id
        )
        recalls[index] = rouge1_recall(probe.answer, tokenizer.decode(generated, skip_special_tokens=True))
        if recalls[index] > SUCCESS_RECALL:
            sums["srh"] += semantic_retrieval_score(rows.double(), prompt_ids, span, generated)
            sums["copy"] += copy_retrieval_score(rows.double(), prompt_ids, span, generated)
        bar.update()
        bar.set_postfix(answered=int((recalls[: index + 1] > SUCCESS_RECALL).sum()))
        if (index + 1) % checkpoint_every == 0 and index + 1 < len(probes):
            save_checkpoint(out, {**sums, "recalls": recalls}, {"next_probe": index + 1}, settings)
    bar.close()
    successes = int((recalls > SUCCESS_RECALL).sum())
    if successes == 0:
        raise KVRuntimeError("the model answered none of the needle probes: no SRH score can be computed")
    artifact = Artifact(
        kind="srh_heads",
        tensors={
            "srh_score": (sums["srh"] / successes).float(),
            "retrieval_score": (sums["copy"] / successes).float(),
            "successful_probes": torch.tensor(successes),
            "probe_recall": recalls,
        },
        model=fingerprint,
        provenance=provenance(corpus, seed),
        params={
            "lengths": lengths,
            "depths": depths,
            "needles": [n.sentence for n in CALIBRATION_NEEDLES],
            "probes": len(probes),
            "success_recall": SUCCESS_RECALL,
            "top_heads": 4,
            "prompt_format": "chat" if chat else "raw",
        },
    )
    return artifact
