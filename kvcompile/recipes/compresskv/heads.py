"""`kvcompile heads`: Semantic Retrieval Head scores (and the classic retrieval-head scores) from needle probes."""

from __future__ import annotations

import torch

from kvcompile.calibration.corpus import Corpus
from kvcompile.calibration.job import CompileJob
from kvcompile.calibration.partial_statistics import StatisticsRun, accumulate, finish_or_partial
from kvcompile.calibration.provenance import provenance
from kvcompile.recipes.compresskv.attention_capture import generate_with_attention_rows
from kvcompile.recipes.compresskv.head_scores import copy_retrieval_score, rouge1_recall, semantic_retrieval_score
from kvcompile.recipes.compresskv.settings import HeadsSettings
from kvcompile.tasks.needles import CALIBRATION_NEEDLES, answer_token_positions, probe_grid
from kvruntime import Artifact, KVRuntimeError, model_fingerprint

SUCCESS_RECALL = 0.5  # a probe counts when the answer's ROUGE-1 recall is above this


def compile_head_scores(job: CompileJob, corpus: Corpus, settings: HeadsSettings) -> Artifact:
    """The srh_heads artifact (or this shard's partial statistics)."""
    model, tokenizer = job.model, job.tokenizer
    lengths, depths, seed = list(settings.lengths), list(settings.depths), settings.seed
    probes = probe_grid(corpus, tokenizer, lengths, depths, seed, settings.chat)
    run = StatisticsRun(
        kind="srh_heads",
        model=model_fingerprint(model),
        settings={
            "corpus_sha256": corpus.sha256,
            "lengths": lengths,
            "depths": depths,
            "seed": seed,
            "needles": len(CALIBRATION_NEEDLES),
            "chat": settings.chat,
        },
        items=len(probes),
        provenance=provenance(corpus, seed),
    )
    shape = (run.model.num_layers, run.model.num_query_heads)
    sums = {
        "srh": torch.zeros(shape, dtype=torch.float64),
        "copy": torch.zeros(shape, dtype=torch.float64),
        "recalls": torch.zeros(len(probes), dtype=torch.float64),
    }

    def add_probe(index: int, sums: dict[str, torch.Tensor]) -> None:
        probe = probes[index]
        prompt_ids, span = answer_token_positions(tokenizer, probe)
        # Small models often restate the whole needle sentence before (or as) the answer: leave room for it.
        sentence_tokens = len(tokenizer(CALIBRATION_NEEDLES[probe.needle].sentence, add_special_tokens=False).input_ids)
        rows, generated = generate_with_attention_rows(
            model, torch.tensor([prompt_ids], device=model.device), sentence_tokens + 8, tokenizer.eos_token_id
        )
        rows = rows.cpu()  # the sums live on the CPU, whatever the model's device
        sums["recalls"][index] = recall = rouge1_recall(
            probe.answer, tokenizer.decode(generated, skip_special_tokens=True)
        )
        if recall > SUCCESS_RECALL:
            sums["srh"] += semantic_retrieval_score(rows.double(), prompt_ids, span, generated)
            sums["copy"] += copy_retrieval_score(rows.double(), prompt_ids, span, generated)

    sums = accumulate(run, sums, add_probe, job, "needle probes", "probe")
    return finish_or_partial(run, sums, [job.shard.describe()], finish_head_scores)


def finish_head_scores(sums: dict[str, torch.Tensor], run: StatisticsRun) -> Artifact:
    """Mean scores over the probes the model answered."""
    successes = int((sums["recalls"] > SUCCESS_RECALL).sum())
    if successes == 0:
        raise KVRuntimeError("the model answered none of the needle probes: no SRH score can be computed")
    return Artifact(
        kind="srh_heads",
        tensors={
            "srh_score": (sums["srh"] / successes).float(),
            "retrieval_score": (sums["copy"] / successes).float(),
            "successful_probes": torch.tensor(successes),
            "probe_recall": sums["recalls"].float(),
        },
        model=run.model,
        provenance=run.provenance,
        params={
            "lengths": run.settings["lengths"],
            "depths": run.settings["depths"],
            "needles": [n.sentence for n in CALIBRATION_NEEDLES],
            "probes": run.items,
            "success_recall": SUCCESS_RECALL,
            "top_heads": 4,
            "prompt_format": "chat" if run.settings["chat"] else "raw",
        },
    )
