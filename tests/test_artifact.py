"""The artifact format: round trip, atomic writes, and every way a file can be refused."""

import json
import struct
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import save_file

from kvruntime.artifacts.artifact import Artifact, load_artifact, read_artifact, save_artifact
from kvruntime.artifacts.fingerprint import model_fingerprint
from kvruntime.errors import ArtifactError, KVRuntimeError


@pytest.fixture
def llama():
    return tiny_model("llama")


def make_artifact(model, kind="layer_budgets", **tensors) -> Artifact:
    return Artifact(
        kind=kind,
        tensors=tensors or {"layer_error": torch.linspace(0, 1, model.config.num_hidden_layers)},
        model=model_fingerprint(model),
        provenance={"command": "test", "seed": 0, "calibration_data": "none", "calibration_hash": "0"},
        params={"note": "made in a test"},
    )


def test_round_trip_keeps_tensors_and_metadata(tmp_path, llama):
    path = save_artifact(make_artifact(llama), tmp_path / "a.safetensors")
    loaded = load_artifact(path, model=llama, kind="layer_budgets")
    assert torch.equal(loaded.tensors["layer_error"], torch.linspace(0, 1, 4))
    assert loaded.model == model_fingerprint(llama)
    assert loaded.params == {"note": "made in a test"} and loaded.provenance["seed"] == 0
    assert [p.name for p in tmp_path.iterdir()] == ["a.safetensors"]  # no temporary file left


def test_a_failed_write_leaves_nothing_under_the_final_name(tmp_path, llama, monkeypatch):
    target = tmp_path / "a.safetensors"
    save_artifact(make_artifact(llama), target)
    before = target.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_bytes", crash)
    with pytest.raises(KVRuntimeError, match="cannot write .*a.safetensors: disk full"):
        save_artifact(make_artifact(llama, layer_error=torch.zeros(4)), target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["a.safetensors"]


def test_truncated_file_is_refused(tmp_path, llama):
    path = save_artifact(make_artifact(llama), tmp_path / "a.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 7])
    with pytest.raises(ArtifactError, match="not a readable safetensors file"):
        read_artifact(path)


def test_file_that_is_not_safetensors_is_refused(tmp_path):
    path = tmp_path / "notes.safetensors"
    path.write_text("just some text, not an artifact")
    with pytest.raises(ArtifactError, match="not a readable safetensors file"):
        read_artifact(path)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(ArtifactError, match="no such artifact file"):
        read_artifact(tmp_path / "missing.safetensors")


def test_safetensors_without_kvcompile_metadata_is_refused(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(3)}, str(path))
    with pytest.raises(ArtifactError, match="without kvcompile metadata"):
        read_artifact(path)


def _rewrite_metadata(path, **changes):
    """Edit the JSON header of a safetensors file in place (same tensors)."""
    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + size])
    header["__metadata__"].update(changes)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + size :])


def test_other_format_version_is_refused(tmp_path, llama):
    path = save_artifact(make_artifact(llama), tmp_path / "a.safetensors")
    _rewrite_metadata(path, format_version="99")
    with pytest.raises(ArtifactError, match="format version '99'"):
        read_artifact(path)


def test_changed_tensor_bytes_fail_the_checksum(tmp_path, llama):
    path = save_artifact(make_artifact(llama), tmp_path / "a.safetensors")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # flip one bit of the last tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="checksum"):
        read_artifact(path)


def test_nan_tensors_are_refused_on_write_and_on_read(tmp_path, llama):
    bad = make_artifact(llama, layer_error=torch.tensor([0.0, float("nan"), 1.0, 2.0]))
    with pytest.raises(ArtifactError, match="NaN or infinite"):
        save_artifact(bad, tmp_path / "a.safetensors")
    assert not any(tmp_path.iterdir())


def test_wrong_kind_is_refused(tmp_path, llama):
    path = save_artifact(make_artifact(llama), tmp_path / "a.safetensors")
    with pytest.raises(ArtifactError, match="kind 'layer_budgets', expected 'srh_heads'"):
        load_artifact(path, kind="srh_heads")


def test_artifact_of_another_architecture_names_the_differences(tmp_path, llama):
    path = save_artifact(make_artifact(llama), tmp_path / "a.safetensors")
    other = tiny_model("qwen2")
    with pytest.raises(ArtifactError, match="another model.*architecture: LlamaForCausalLM vs Qwen2ForCausalLM"):
        load_artifact(path, model=other)
    with pytest.raises(ArtifactError, match="another model"):
        load_artifact(path, model=other, force=True)  # force never overrides a shape mismatch


def test_other_checkpoint_of_same_shape_needs_force(tmp_path, llama):
    path = save_artifact(make_artifact(llama), tmp_path / "a.safetensors")
    retrained = tiny_model("llama", seed=1)
    with pytest.raises(ArtifactError, match="another checkpoint.*--force"):
        load_artifact(path, model=retrained)
    with pytest.warns(UserWarning, match="applied anyway"):
        assert load_artifact(path, model=retrained, force=True).kind == "layer_budgets"


def test_fingerprint_ignores_dtype_but_not_weights(llama):
    assert model_fingerprint(llama) == model_fingerprint(tiny_model("llama").to(torch.bfloat16))
    assert model_fingerprint(llama).weights_hash != model_fingerprint(tiny_model("llama", seed=3)).weights_hash


def test_unknown_kind_is_refused_on_write(tmp_path, llama):
    with pytest.raises(ArtifactError, match="unknown artifact kind"):
        save_artifact(make_artifact(llama, kind="mystery"), tmp_path / "a.safetensors")
