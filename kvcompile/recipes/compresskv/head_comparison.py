"""How Semantic Retrieval Heads differ from classic retrieval heads: rank correlation and the heads only SRH finds."""

from __future__ import annotations

import dataclasses

import torch
from scipy.stats import spearmanr

from kvruntime import Artifact


@dataclasses.dataclass
class HeadComparison:
    spearman: float
    layers_with_different_top: int
    layers: int
    srh_only: list[tuple[int, int]]  # (layer, query head) in SRH's top-k of its layer but not in the classic top-k
    top_k: int
    layers_without_classic_heads: int  # layers where no head ever copied the answer (classic score all zero)


def compare_heads(srh: torch.Tensor, classic: torch.Tensor, top_k: int = 4) -> HeadComparison:
    rho = spearmanr(srh.flatten().numpy(), classic.flatten().numpy()).statistic
    srh_only, differing = [], 0
    for layer in range(srh.shape[0]):
        srh_top = set(srh[layer].topk(top_k).indices.tolist())
        # A head with a zero classic score is no classic retrieval head, whatever topk's tie order says.
        classic_top = {h for h in classic[layer].topk(top_k).indices.tolist() if classic[layer, h] > 0}
        differing += srh_top != classic_top
        srh_only += [(layer, head) for head in sorted(srh_top - classic_top)]
    silent = int((classic.amax(dim=1) <= 0).sum())
    return HeadComparison(float(rho), differing, srh.shape[0], srh_only, top_k, silent)


def describe_head_comparison(artifact: Artifact) -> str:
    top_k = artifact.params.get("top_heads", 4)
    result = compare_heads(artifact.tensors["srh_score"], artifact.tensors["retrieval_score"], top_k)
    shown = ", ".join(f"L{layer}H{head}" for layer, head in result.srh_only[:24])
    more = f" (+{len(result.srh_only) - 24} more)" if len(result.srh_only) > 24 else ""
    return (
        f"probes answered: {int(artifact.tensors['successful_probes'])} of {artifact.params['probes']}\n"
        f"Spearman rank correlation of SRH and classic retrieval scores: {result.spearman:.3f}\n"
        f"layers whose top-{top_k} heads differ: {result.layers_with_different_top} of {result.layers} "
        f"({result.layers_without_classic_heads} layers have no classic retrieval head at all)\n"
        f"top-{top_k} heads only SRH finds ({len(result.srh_only)}): {shown}{more}"
    )
