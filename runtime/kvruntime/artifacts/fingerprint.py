"""Model fingerprint: what an artifact records about the model it was compiled for, and how two are compared."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ArtifactError, short_repr
from ..models.model_spec import GROWING, language_config, loaded_layer_kinds

if TYPE_CHECKING:  # torch only where a model is fingerprinted: a manifest's fingerprint is checked without it
    import torch
    from torch import nn


@dataclasses.dataclass(frozen=True)
class ModelFingerprint:
    """Shape facts of a model plus a hash of a few real weights (tells two checkpoints of one architecture apart)."""

    architecture: str
    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    weights_hash: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelFingerprint:
        """The fingerprint of a JSON object; ValueError naming the first field missing or of the wrong type."""
        if not isinstance(data, dict):
            raise ValueError(f"fingerprint is a JSON {type(data).__name__}, not an object")
        fields = dataclasses.fields(cls)
        missing = {f.name for f in fields} - set(data)
        if missing:
            raise ValueError(f"fingerprint lacks {sorted(missing)}")
        for field in fields:
            value = data[field.name]
            if field.type in (int, "int") and (type(value) is not int or value < 1):
                raise ValueError(f"fingerprint {field.name} is {short_repr(value)}, not a positive integer")
            if field.type in (str, "str") and (type(value) is not str or not value):
                raise ValueError(f"fingerprint {field.name} is {short_repr(value)}, not a non-empty string")
        return cls(**{f.name: data[f.name] for f in fields})

    def describe(self) -> str:
        """One line for `kvcompile info`: the shape facts and the weights hash."""
        return (
            f"{self.architecture}, {self.num_layers} layers, {self.num_query_heads} query heads, "
            f"{self.num_kv_heads} KV heads, head dim {self.head_dim}, weights {self.weights_hash}"
        )

    def shape_differences(self, other: ModelFingerprint) -> dict[str, str]:
        """Differences that make an artifact's tensors meaningless for the other model: field -> 'a vs b'."""
        names = ("architecture", "num_layers", "num_query_heads", "num_kv_heads", "head_dim")
        return {n: f"{getattr(self, n)} vs {getattr(other, n)}" for n in names if getattr(self, n) != getattr(other, n)}


# Elements hashed per tensor: enough to separate checkpoints, cheap for any model size.
_HASHED_ELEMENTS = 4096


def _hashed_weights(model: nn.Module) -> list[torch.Tensor]:
    """The input embedding and the first and last parameters of the decoder stack, in a fixed order."""
    params = [p for name, p in model.named_parameters() if ".layers." in name]
    chosen = [model.get_input_embeddings().weight]
    if params:
        chosen += [params[0], params[-1]]
    return chosen


def model_fingerprint(model: nn.Module) -> ModelFingerprint:
    """Fingerprint of a transformers causal LM. Weights are hashed in bfloat16, so one checkpoint loaded in
    float32, float16 or bfloat16 has one fingerprint."""
    import torch

    digest = hashlib.sha256()
    with torch.no_grad():
        for weight in _hashed_weights(model):
            digest.update(_hashed_sample(weight.detach()))
    return _fingerprint(model, digest.hexdigest()[:16])


def _hashed_sample(weight: torch.Tensor) -> bytes:
    """The bytes hashed of one weight: its first elements in bfloat16."""
    import torch

    sample = weight.flatten()[:_HASHED_ELEMENTS].to("cpu", torch.bfloat16)
    return sample.view(torch.int16).numpy().tobytes()


def _fingerprint(model: nn.Module, weights_hash: str) -> ModelFingerprint:
    """The shape facts of `model`'s config with the hash of its weights."""
    config = language_config(model.config)
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    architectures = getattr(model.config, "architectures", None) or [type(model).__name__]
    return ModelFingerprint(
        architecture=architectures[0],
        # The layers an artifact describes: those whose cache grows (a sliding-window layer is left to the model).
        num_layers=sum(kind == GROWING for kind in loaded_layer_kinds(config)) or config.num_hidden_layers,
        num_query_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        weights_hash=weights_hash,
    )


def folder_fingerprint(folder: Path) -> ModelFingerprint | None:
    """What `model_fingerprint` gives the model saved in a Hugging Face folder, read without loading its weights:
    the model built on the meta device names the hashed weights, whose first elements are read from the folder's
    safetensors files. None where they are not all there (weights in another format, or stored under other names):
    the fingerprint is then known once the model is loaded."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    names = {id(parameter): name for name, parameter in skeleton.named_parameters()}
    wanted = [names.get(id(weight)) for weight in _hashed_weights(skeleton)]
    samples = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in set(wanted) & set(handle.keys()):
                part = handle.get_slice(name)
                shape = part.get_shape()
                row = math.prod(shape[1:]) if len(shape) > 1 else 1
                samples[name] = _hashed_sample(
                    part[: -(-_HASHED_ELEMENTS // row)] if shape else handle.get_tensor(name)
                )
    if None in wanted or not set(wanted) <= set(samples):
        return None
    digest = hashlib.sha256()
    for name in wanted:
        digest.update(samples[name])
    return _fingerprint(skeleton, digest.hexdigest()[:16])


def check_compiled_for(
    compiled_for: ModelFingerprint,
    kind: str,
    where: str,
    model: ModelFingerprint,
    force: bool = False,
    warn: bool = True,
) -> None:
    """Refuse an artifact of `kind` (at `where`) compiled for `compiled_for` on `model`: another shape always (but
    a depth-portable kind's other depth, with `force`), other weights of the same shape unless `force`, which warns
    (unless `warn` is off: a check before the model loads leaves the warning to where the artifact is applied).
    Torch-free: a header's fingerprint is checked before the model loads."""
    from .artifact_kinds import ARTIFACT_KINDS

    shape_diffs = compiled_for.shape_differences(model)
    depth_only = ARTIFACT_KINDS[kind].depth_portable and set(shape_diffs) <= {"architecture", "num_layers"}
    if shape_diffs and not depth_only:
        described = "; ".join(f"{name}: {values}" for name, values in shape_diffs.items())
        raise ArtifactError(f"{where}: compiled for another model ({described}, artifact vs model)")
    if shape_diffs:
        _refuse_unless_forced(
            f"{where}: compiled for {compiled_for.architecture} with {compiled_for.num_layers} layers, the model is "
            f"{model.architecture} with {model.num_layers}",
            "by relative depth",
            force,
            warn,
        )
    elif compiled_for.weights_hash != model.weights_hash:
        _refuse_unless_forced(
            f"{where}: compiled for another checkpoint of {model.architecture} "
            f"(weights hash {compiled_for.weights_hash} vs {model.weights_hash})",
            "anyway",
            force,
            warn,
        )


def _refuse_unless_forced(message: str, how: str, force: bool, warn: bool) -> None:
    if not force:
        raise ArtifactError(f"{message}; pass force=True (--force) to apply it {how}")
    if warn:
        warnings.warn(f"{message}; applied {how} because force was set", stacklevel=5)
