"""kvpress presses that apply kvcompile's compiled artifacts, so kvpress's pipeline, its wrappers (AdaKVPress,
DMSPress, PerLayerCompressionPress, ...) and its evaluation run our compiled scores. Needs kvpress (`pip install
kvpress`); imported only on request.

    from kvruntime.integrations.kvpress import DistilledPress
    press = DistilledPress.from_artifact("artifacts/smollm2-135m-instruct", compression_ratio=0.5)
    pipe(context, question=question, press=press)["answer"]

Each press scores the prefill's tokens exactly as kvruntime's method of the same name does, and kvpress's
ScorerPress keeps each KV head's top tokens, the same count in every layer and head. Against kvruntime's methods:
- `DistilledPress`: the student's scores, the first `sinks` and the last `window` tokens kept, as `distilled`; its
  layers all keep the same count and it has no copy penalty (a hook never sees the prompt's ids), which is
  kvruntime's `distilled:allocation=uniform,copy_penalty=0` (kvruntime's default,
  `allocation=compiled`, takes the artifact's compiled layer shares, which kvpress's `PerLayerCompressionPress` can
  take too; `allocation=dynamic` ranks the layers in one pool). Under DMSPress with `decoding=True` each generated token is scored on
  its own: its likeness to the earlier tokens (a feature) reads 0, as for the prompt's first two tokens.
- `SRHPress`: CompressKV's semantic-retrieval-head scores (`srh`), one index set shared by the KV heads of a layer;
  `srh+error-aware`' error-aware budgets are kvruntime's own.
A press checks its artifact against the model it is applied to (`post_init_from_model`), as kvruntime does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import ClassVar

import torch
from kvpress import ScorerPress
from torch import nn
from transformers import PreTrainedModel

from ..artifacts.artifact import Artifact, check_artifact_matches_model, load_artifact
from ..artifacts.bundle import resolve_artifact_path
from ..artifacts.fingerprint import model_fingerprint
from ..errors import KVRuntimeError
from ..math.selection import protect_window
from ..methods import Method
from ..methods.distilled import with_leverage
from ..methods.resolved import ResolvedRequest, resolve_request
from ..models.layout import model_layout
from ..plumbing.attention import captured_logits, captured_queries, capturing_queries, per_layer_attention
from ..registry import method_spec


@dataclasses.dataclass
class CompiledScorerPress(ScorerPress):
    """A ScorerPress whose scores come from a kvruntime method built from a compiled artifact (`from_artifact`)."""

    method_name: ClassVar[str]
    # Its `__call__` adds only kvruntime's attention function and the query capture, which a replay of a recorded
    # prefill (`kvcompile eval --shared-prefill`) sets itself: the press runs on the recording.
    replays_recorded_prefill: ClassVar[bool] = True
    method: Method | None = None
    artifact: Artifact | None = None
    force: bool = False  # apply an artifact compiled for another checkpoint of the same shape (with a warning)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.method is None or self.artifact is None:
            raise KVRuntimeError(f"build {type(self).__name__} with {type(self).__name__}.from_artifact(path)")

    @classmethod
    def from_artifact(
        cls, path: str | os.PathLike, compression_ratio: float = 0.0, force: bool = False, **options: object
    ) -> CompiledScorerPress:
        """The press from an artifact file, or a folder holding one of the kind the method needs; `options` are
        the method's (as `kvruntime.compress(..., options=...)` takes them)."""
        kind = method_spec(cls.method_name)[0].needs
        artifact = load_artifact(resolve_artifact_path(path, kind), kind=kind)
        return cls.from_request(
            resolve_request(cls.method_name, compression_ratio, None, "padded", [artifact], options), force=force
        )

    @classmethod
    def from_request(cls, resolved: ResolvedRequest, force: bool = False) -> CompiledScorerPress:
        """The press of a request resolved already (`kvruntime.methods.resolved.resolve_request`) for this press's method at
        one ratio: its method as built there, its artifact as read there."""
        if resolved.method_name != cls.method_name:
            raise KVRuntimeError(
                f"{cls.__name__} applies {cls.method_name}, not {resolved.method_name or 'an instance'}"
            )
        request = resolved.request()
        if request.ratio is None:
            raise KVRuntimeError(f"{cls.__name__} takes a compression ratio, not a budget (kvpress's presses do)")
        if resolved.method.merge != "off":
            raise KVRuntimeError(
                f"{cls.__name__}: kvpress cuts the cache itself and merges nothing; wrap the press in kvpress's "
                f"MergingPress instead of merge={resolved.method.merge}"
            )
        kind = method_spec(cls.method_name)[0].needs
        artifact = next(artifact for artifact in resolved.artifacts if artifact.kind == kind)
        return cls(compression_ratio=request.ratio, method=resolved.method, artifact=artifact, force=force)

    def post_init_from_model(self, model: PreTrainedModel) -> None:
        model_layout(model).check_every_layer_cut(type(self).__name__)
        check_artifact_matches_model(self.artifact, model_fingerprint(model), force=self.force)

    @contextlib.contextmanager
    def __call__(self, model: PreTrainedModel) -> Iterator[None]:
        """kvpress's hooks, with the model's queries captured where its attention runs (kvruntime's attention
        function) for the scores to read."""
        with per_layer_attention(model), capturing_queries(model_layout(model).cut_modules, self.method.window):
            with super().__call__(model):
                yield

    def score(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor | None,
        kwargs: dict,
    ) -> torch.Tensor:
        return self.layer_scores(module, hidden_states, keys, kwargs).to(keys.dtype)

    def layer_scores(
        self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, kwargs: dict
    ) -> torch.Tensor:
        """The layer's scores [B, Hkv, N] (kvpress's `score`, without the arguments the compiled methods ignore)."""
        raise NotImplementedError


@dataclasses.dataclass
class DistilledPress(CompiledScorerPress):
    """kvruntime's `distilled` scores (a `distilled_scorer` artifact) as a kvpress press."""

    method_name: ClassVar[str] = "distilled"

    @classmethod
    def from_artifact(
        cls, path: str | os.PathLike, compression_ratio: float = 0.0, force: bool = False, **options: object
    ) -> CompiledScorerPress:
        # A kvpress hook sees hidden states, never the prompt's ids, which the copy penalty counts.
        if options.get("copy_penalty", 0.0):
            raise KVRuntimeError(
                "DistilledPress: copy_penalty counts the prompt's token ids, which a kvpress hook does not see "
                "(the press is kvruntime's distilled with copy_penalty=0)"
            )
        return super().from_artifact(path, compression_ratio, force, **{**options, "copy_penalty": 0.0})

    def layer_scores(
        self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, kwargs: dict
    ) -> torch.Tensor:
        start = int(kwargs["cache_position"][0])  # 0 for a prefill; a decoding wrapper scores later tokens
        if hidden_states.shape[1] != keys.shape[2]:
            raise KVRuntimeError(
                f"DistilledPress scores the tokens going in ({hidden_states.shape[1]}) and was handed "
                f"{keys.shape[2]} keys: use it on a prefill, or in a wrapper that scores the new tokens (DMSPress)"
            )
        scores = self.method.token_scores(module.layer_idx, hidden_states, start)
        if start > 0:  # a decoding wrapper's new tokens: it protects its own sliding window
            return scores
        # The prompt's last tokens stay, and the keys' leverage is mixed in as kvruntime's prefill does.
        scores = protect_window(scores, min(self.method.window, scores.shape[-1]))
        return with_leverage(scores, keys, self.method.leverage, scores.shape[-1])


@dataclasses.dataclass
class SRHPress(CompiledScorerPress):
    """kvruntime's `srh` scores (CompressKV's semantic retrieval heads, an `srh_heads` artifact) as a kvpress press."""

    method_name: ClassVar[str] = "srh"

    def layer_scores(
        self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, kwargs: dict
    ) -> torch.Tensor:
        queries = captured_queries(module, min(self.method.window, hidden_states.shape[1]))
        return self.method.window_scores(queries, keys, captured_logits(module), module.layer_idx)
