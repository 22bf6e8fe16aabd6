"""Artifact bundles (`kvcompile bundle`, `kvcompile reproduce`, `kvruntime.bundle`) on a tiny Llama saved as a model
folder: a compile writes the same bytes for the same command (so a bundle's manifest can be checked by rerunning
it), a bundle applies exactly as its files do, by folder and by a hub repo id in a local Hugging Face cache, and a
bundle that does not match its manifest or its model is refused in one line."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from conftest import place_in_hub_cache, save_char_tokenizer, tiny_model
from typer.testing import CliRunner

import kvruntime
from kvcompile import cli
from kvruntime.artifact import read_artifact, save_artifact
from kvruntime.bundle import read_bundle, resolve_artifact_path
from kvruntime.fingerprint import ModelFingerprint

runner = CliRunner()
STATS = ["stats", "--prompts", "2", "--prompt-tokens", "64", "--ratios", "0.5,0.75"]
HUB_ID = "someone/tiny-llama-kvcompile"


def invoke(args: list[str]) -> str:
    result = runner.invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    return result.output


def refused(args: list[str], message: str) -> None:
    result = runner.invoke(cli.app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Llama saved as a model folder (weights and a character tokenizer), and kvcompose statistics compiled
    for it by the command line."""
    root = tmp_path_factory.mktemp("bundle")
    model_folder = root / "model"
    tiny_model("llama").save_pretrained(model_folder)
    save_char_tokenizer(model_folder)
    artifact = root / "compiled" / "kvcompose_stats.safetensors"
    invoke([*STATS, "--model", str(model_folder), "--out", str(artifact)])
    return model_folder, artifact


@pytest.fixture
def bundle(compiled: tuple[Path, Path], tmp_path: Path) -> Path:
    invoke(["bundle", str(compiled[1].parent), "--out", str(tmp_path / "bundle")])
    return tmp_path / "bundle"


def test_the_same_command_writes_the_same_bytes(compiled, tmp_path):
    """Options in another order and another --out: the artifact's bytes are the same (safetensors alone writes its
    metadata in hash-map order); the date and wall time go to the run record beside it."""
    model_folder, first = compiled
    again = tmp_path / "elsewhere" / "stats.safetensors"
    invoke(["stats", "--ratios", "0.5,0.75", "--model", str(model_folder), "--prompt-tokens", "64", "--prompts", "2",
            "--out", str(again)])  # fmt: skip
    assert again.read_bytes() == first.read_bytes()
    command = read_artifact(first).provenance["command"]
    assert command.startswith("kvcompile stats --ratios 0.5,0.75") and "--out" not in command
    assert "--seed 0" in command and f"--model {model_folder}" in command  # every setting, defaults too
    record = json.loads(again.with_suffix(".run.json").read_text())
    assert record["run_of"] == again.name and record["compile_seconds"] > 0 and "created" in record


def test_a_bundle_holds_the_artifacts_a_manifest_and_a_model_card(compiled, bundle):
    model_folder, artifact = compiled
    names = sorted(p.name for p in bundle.iterdir())
    assert names == [
        "README.md", "kvcompose_stats.png", "kvcompose_stats.run.json", "kvcompose_stats.safetensors", "manifest.json"
    ]  # fmt: skip
    manifest = json.loads((bundle / "manifest.json").read_text())
    (entry,) = manifest["artifacts"]
    assert entry["sha256"] == hashlib.sha256(artifact.read_bytes()).hexdigest()
    assert (bundle / "kvcompose_stats.safetensors").read_bytes() == artifact.read_bytes()
    assert entry["provenance"]["calibration_sha256"] and entry["provenance"]["libraries"]["torch"] == torch.__version__
    model = kvruntime.model_fingerprint(kvruntime.load_model(str(model_folder))[0])
    assert manifest["model"] == model.to_dict() and manifest["base_model"] is None  # a local folder has no hub id
    card = (bundle / "README.md").read_text()
    front = card.split("---\n")[1]
    assert "library_name: kvcompile" in front and "- kv-cache-compression" in front and "base_model" not in front
    assert entry["provenance"]["command"] in card and 'kvruntime.compress(model, "kvcompose"' in card


def test_reproduce_reruns_the_recorded_command_and_compares_the_bytes(bundle, tmp_path):
    output = invoke(["reproduce", str(bundle)])
    assert "kvcompose_stats.safetensors: reproduced" in output
    # An artifact whose recorded command is not what made it (seed 0 recorded, seed 1 used): reproduce says so.
    seed_one = tmp_path / "seed1" / "kvcompose_stats.safetensors"
    recorded = read_artifact(bundle / "kvcompose_stats.safetensors").provenance["command"]
    model = recorded.split("--model ")[1].split()[0]
    invoke([*STATS, "--model", model, "--seed", "1", "--out", str(seed_one)])
    artifact = read_artifact(seed_one)
    artifact.provenance["command"] = recorded
    save_artifact(artifact, seed_one)
    invoke(["bundle", str(seed_one), "--out", str(tmp_path / "mislabelled")])
    result = runner.invoke(cli.app, ["reproduce", str(tmp_path / "mislabelled")])
    assert result.exit_code == 1 and "kvcompose_stats.safetensors: differs: sha256" in result.output


def test_a_bundle_applies_as_its_files_by_folder_and_by_hub_id(compiled, bundle, tmp_path, monkeypatch):
    """The same kept entries and the same greedy tokens with the artifact file, the bundle's folder, and the bundle
    as a hub repo id found in the local cache (offline)."""
    model_folder, artifact = compiled
    model, _ = kvruntime.load_model(str(model_folder))
    place_in_hub_cache(bundle, tmp_path / "hub", HUB_ID)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    prompt = torch.randint(3, 96, (1, 64), generator=torch.Generator().manual_seed(3))
    outcomes = []
    for source in (artifact, bundle, HUB_ID):
        with kvruntime.compress(model, "kvcompose", ratio=0.5, artifacts=[source]) as session:
            tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
        outcomes.append((tokens.tolist(), session.report.entries_per_layer))
    assert outcomes[0] == outcomes[1] == outcomes[2]
    assert resolve_artifact_path(HUB_ID, "kvcompose_stats").read_bytes() == artifact.read_bytes()
    info = invoke(["info", HUB_ID])
    assert "kvcompile bundle (1 artifact files, each matching its manifest)" in info and "kvcompose_stats" in info


@pytest.mark.parametrize(
    "damage", ["bytes changed", "file missing", "file not listed", "kind changed", "model changed"]
)
def test_a_bundle_that_does_not_match_its_manifest_is_refused_in_one_line(bundle, compiled, damage):
    manifest_path = bundle / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    if damage == "bytes changed":
        artifact = read_artifact(bundle / "kvcompose_stats.safetensors")
        artifact.params["note"] = "edited after bundling"
        save_artifact(artifact, bundle / "kvcompose_stats.safetensors")  # a valid artifact, other bytes
        message = "kvcompose_stats.safetensors does not match its manifest (sha256 differs)"
    elif damage == "file missing":
        (bundle / "kvcompose_stats.safetensors").unlink()
        message = "kvcompose_stats.safetensors is listed in its manifest but missing"
    elif damage == "file not listed":
        shutil.copyfile(compiled[1], bundle / "extra.safetensors")
        message = "extra.safetensors is not in its manifest"
    elif damage == "kind changed":
        manifest["artifacts"][0]["kind"] = "srh_heads"
        message = "kvcompose_stats.safetensors is a kvcompose_stats artifact, its manifest says srh_heads"
    else:
        manifest["model"]["num_layers"] = 30
        message = "kvcompose_stats.safetensors was compiled for another model than its manifest's"
    manifest_path.write_text(json.dumps(manifest))
    refused(["info", str(bundle)], message)
    with pytest.raises(kvruntime.ArtifactError, match=message.split(" (")[0]):
        read_bundle(bundle)


def test_a_bundle_of_another_model_is_refused(bundle):
    other = tiny_model("qwen2")
    with pytest.raises(kvruntime.ArtifactError, match="kvcompose_stats.safetensors: compiled for another model"):
        with kvruntime.compress(other, "kvcompose", ratio=0.5, artifacts=[bundle]):
            pass


def test_bundle_refuses_bad_input_in_one_line(compiled, bundle, tmp_path):
    model_folder, artifact = compiled
    refused(["bundle", str(artifact), "--out", str(model_folder)], "exists and is not a bundle")
    refused(["bundle", str(artifact.parent), "--out", str(artifact.parent / "b")], "overlaps the source")
    other = tmp_path / "other.safetensors"
    save_artifact(kvruntime.Artifact("srh_heads", {"srh_score": torch.rand(30, 9)}, *_default_shaped()), other)
    refused(["bundle", str(artifact), str(other), "--out", str(tmp_path / "mixed")], "compiled for another model")
    refused(["bundle", str(tmp_path / "nothing"), "--out", str(tmp_path / "b")], "no such artifact file")
    refused(["reproduce", str(bundle), "--only", "srh_heads"], "--only srh_heads: the bundle holds kvcompose_stats")
    refused(["info", str(model_folder)], "not a bundle (no manifest.json")
    assert not (tmp_path / "mixed").exists() and not (tmp_path / "b").exists()


def _default_shaped() -> tuple:
    fingerprint = ModelFingerprint("LlamaForCausalLM", 30, 9, 3, 64, "0" * 16)
    return fingerprint, {}, {}
