"""`kvcompile heads`: Semantic Retrieval Head scores (and the classic retrieval-head scores) from needle probes."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kvcompile.calibration.corpus import Corpus
from kvcompile.calibration.job import CompileJob
from kvcompile.calibration.partial_statistics import StatisticsRun, accumulate, finish_or_partial
from kvcompile.calibration.provenance import provenance
from kvcompile.recipe import CorpusRecipe
from kvcompile.recipes.compresskv.attention_capture import generate_with_attention_rows
from kvcompile.recipes.compresskv.head_comparison import describe_head_comparison
from kvcompile.recipes.compresskv.head_scores import copy_retrieval_score, rouge1_recall, semantic_retrieval_score
from kvcompile.recipes.compresskv.plots import plot_head_scores
from kvcompile.tasks.needles import CALIBRATION_NEEDLES, answer_token_positions, probe_grid
from kvruntime import Artifact, KVRuntimeError, model_fingerprint

SUCCESS_RECALL = 0.5  # a probe counts when the answer's ROUGE-1 recall is above this


MIN_PROBE_TOKENS = 128  # a needle sentence, its question and some haystack around it


@dataclasses.dataclass(frozen=True)
class HeadsSettings:
    """The needle-probe grid: context lengths (tokens) x needle depths (0 = start, 1 = end) x needles."""

    lengths: tuple[int, ...] = (512, 1024, 1536, 2048)
    depths: tuple[float, ...] = (0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1)
    seed: int = 0
    chat: bool = True  # probes in the model's chat template (instruct models), else raw text

    def check(self) -> None:
        if not self.lengths or not self.depths or any(not 0 <= d <= 1 for d in self.depths):
            raise KVRuntimeError("--lengths needs at least one length and --depths values in [0, 1]")
        if min(self.lengths) < MIN_PROBE_TOKENS:
            raise KVRuntimeError(
                f"--lengths {min(self.lengths)}: a needle probe needs at least {MIN_PROBE_TOKENS} tokens"
            )

    def check_model(self, model: nn.Module) -> None:
        longest = getattr(model.config, "max_position_embeddings", None)
        if longest is not None and max(self.lengths) > longest:
            raise KVRuntimeError(f"--lengths {max(self.lengths)} is longer than the model's {longest} positions")


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


class HeadsRecipe(CorpusRecipe):
    kind = "srh_heads"
    compile = staticmethod(compile_head_scores)
    finisher = staticmethod(finish_head_scores)
    plotter = staticmethod(plot_head_scores)

    def check_model(self, settings: HeadsSettings, model: nn.Module) -> None:
        settings.check_model(model)

    def describe(self, artifact: Artifact) -> str:
        return describe_head_comparison(artifact)
