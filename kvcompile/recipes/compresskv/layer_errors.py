"""`kvcompile layer-errors`: each layer's compression error, the input of CompressKV's error-aware layer budgets.

Greedy generation runs with the FULL cache on calibration prompts. At prefill, each layer remembers the tokens the
SRH selection would keep at a tiny budget (24 + the 8-token window); at every decoding step it compares its
output over the full cache with its output over the kept tokens (plus the generated ones). The model keeps running
on the full cache, so errors do not cascade between layers.
"""

from __future__ import annotations

import torch
from torch import nn

from kvcompile.calibration.corpus import Corpus, calibration_prompts
from kvcompile.calibration.job import CompileJob
from kvcompile.calibration.partial_statistics import StatisticsRun, accumulate, finish_or_partial
from kvcompile.calibration.provenance import provenance
from kvcompile.recipes.compresskv.attention_capture import attention_output
from kvcompile.recipes.compresskv.settings import LayerErrorsSettings
from kvruntime import Artifact, model_fingerprint
from kvruntime.artifacts.artifact import tensors_checksum
from kvruntime.math.selection import top_indices
from kvruntime.methods import SemanticRetrievalHeads
from kvruntime.models.layout import model_layout
from kvruntime.plumbing.attention import captured_logits
from kvruntime.plumbing.window import query_hooks

PROBE_BUDGET = 32  # tokens kept per layer while measuring, window included (CompressKV's setting)


def relative_error(full: torch.Tensor, compressed: torch.Tensor) -> float:
    return float((compressed - full).norm() / (full.norm() + 1e-6))


def normalised_layer_error(per_source: torch.Tensor) -> torch.Tensor:
    """[sources, layers] summed errors -> one profile summing to 1: each source normalised over layers (L1),
    averaged over sources, normalised again."""
    profiles = per_source / per_source.sum(dim=1, keepdim=True).clamp_min(1e-12)
    mean = profiles.mean(dim=0)
    return mean / mean.sum()


def layer_errors_of_prompt(
    model: nn.Module, selection: SemanticRetrievalHeads, prompt_ids: torch.Tensor, new_tokens: int
) -> torch.Tensor:
    """Summed relative output error per layer over the decoding steps of one prompt: [layers]."""
    length = prompt_ids.shape[1]
    kept: dict[int, torch.Tensor] = {}
    errors = torch.zeros(len(model_layout(model).cut_modules), dtype=torch.float64)  # on the CPU, with the sums

    def measure(
        layer: int,
        module: nn.Module,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        q_len: int,
        _: object,
    ) -> None:
        if q_len > 1:  # prefill: remember what the SRH selection keeps at the probe budget
            scores = selection.window_scores(queries, keys, captured_logits(module), layer)
            kept[layer] = top_indices(scores, min(PROBE_BUDGET, length))
            return
        generated = torch.arange(length, keys.shape[2], device=keys.device).expand(*kept[layer].shape[:2], -1)
        index = torch.cat([kept[layer], generated], dim=-1).unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        full = attention_output(module, queries, keys, values)
        compressed = attention_output(module, queries, keys.gather(2, index), values.gather(2, index))
        errors[layer] += relative_error(full, compressed)

    with query_hooks(model, measure, window=selection.window), torch.no_grad():
        model.generate(
            prompt_ids.to(model.device), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
    return errors


def compile_layer_errors(job: CompileJob, corpus: Corpus, heads: Artifact, settings: LayerErrorsSettings) -> Artifact:
    """The layer_budgets artifact (or this shard's partial statistics) of the selection of `heads`."""
    model, tokenizer = job.model, job.tokenizer
    prompts, prompt_tokens, new_tokens, seed = (
        settings.prompts,
        settings.prompt_tokens,
        settings.new_tokens,
        settings.seed,
    )
    selection = SemanticRetrievalHeads(head_scores=heads.tensors["srh_score"])
    calibration = calibration_prompts(corpus, tokenizer, prompts, prompt_tokens, seed)
    sources = min(prompts, len(corpus.documents))  # prompts are taken round-robin from the documents
    run = StatisticsRun(
        kind="layer_budgets",
        model=model_fingerprint(model),
        settings={
            "corpus_sha256": corpus.sha256,
            "heads_sha256": tensors_checksum(heads.tensors),
            "prompts": prompts,
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
            "seed": seed,
            "sources": sources,
        },
        items=len(calibration),
        # The heads by their content, not their path: the same heads give the same bytes wherever they lie.
        provenance=provenance(corpus, seed, heads_sha256=tensors_checksum(heads.tensors)),
    )
    sums = {"per_source": torch.zeros(sources, run.model.num_layers, dtype=torch.float64)}

    def add_prompt(index: int, sums: dict[str, torch.Tensor]) -> None:
        source, ids = calibration[index]
        sums["per_source"][source] += layer_errors_of_prompt(model, selection, ids, new_tokens)

    sums = accumulate(run, sums, add_prompt, job, "layer errors", "prompt")
    return finish_or_partial(run, sums, [job.shard.describe()], finish_layer_budgets)


def finish_layer_budgets(sums: dict[str, torch.Tensor], run: StatisticsRun) -> Artifact:
    per_source = sums["per_source"]
    return Artifact(
        kind="layer_budgets",
        tensors={"layer_error": normalised_layer_error(per_source).float(), "raw_error": per_source.float()},
        model=run.model,
        provenance=run.provenance,
        params={
            "probe_budget": PROBE_BUDGET,
            "selection": "srh",
            "prompts": run.settings["prompts"],
            "prompt_tokens": run.settings["prompt_tokens"],
            "new_tokens": run.settings["new_tokens"],
            "sources": run.settings["sources"],
            "allocation": {"rule": "CompressKV Algorithm 1", "minimum": 32, "maximum_factor": 3},
        },
    )
