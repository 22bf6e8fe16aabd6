"""Artifact bundles (`kvcompile bundle`, `kvcompile reproduce`, `kvruntime.artifacts.bundle`) on a tiny Llama saved as a model
folder: a compile writes the same bytes for the same command (so a bundle's manifest can be checked by rerunning
it), a bundle applies exactly as its files do, by folder and by a hub repo id in a local Hugging Face cache, and a
bundle that does not match its manifest or its model is refused in one line."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from conftest import place_in_hub_cache, save_char_tokenizer, tiny_model
from typer.testing import CliRunner

import kvruntime
from kvcompile import cli
from kvcompile.cli import artifacts as cli_artifacts
from kvruntime.artifacts.artifact import read_artifact, save_artifact
from kvruntime.artifacts.bundle import read_bundle, resolve_artifact_path
from kvruntime.artifacts.fingerprint import ModelFingerprint

runner = CliRunner()
STATS = ["stats", "--prompts", "2", "--prompt-tokens", "64", "--ratios", "0.5,0.75"]
HUB_ID = "someone/tiny-llama-kvcompile"
# CompilerKV's tables at their smallest on the tiny model: one budget, two prompts, one round, one risk cell
TABLES = ["--budgets", "80", "--prompts", "2", "--candidates", "3", "--context-tokens", "160", "--continuation", "12"]
TABLES += ["--rounds", "1", "--entropy-bins", "1", "--perplexity-bins", "1"]


def invoke(args: list[str]) -> str:
    result = runner.invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    return result.output


def refused(args: list[str], message: str) -> str:
    result = runner.invoke(cli.app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert "\x1b" not in result.output  # nothing read from a file drives the terminal
    return result.output


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
        ".kvcompile-bundle.json", "README.md", "kvcompose_stats.png", "kvcompose_stats.run.json",
        "kvcompose_stats.safetensors", "manifest.json",
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


def test_reproduce_reruns_the_recorded_command_and_compares_the_bytes(compiled, bundle, tmp_path):
    model = str(compiled[0])  # a local model folder: reproduce reads it only when the user names it
    output = invoke(["reproduce", str(bundle), "--model", model, "--yes"])
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
    result = runner.invoke(cli.app, ["reproduce", str(tmp_path / "mislabelled"), "--model", model, "--yes"])
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


def test_a_mistyped_folder_is_refused_as_a_folder_not_looked_up_on_the_hub(tmp_path, monkeypatch):
    """`dir/bundle` has the shape of a hub repo id; beside a folder `dir` it is a path with a typo: refused as
    such, without a hub lookup. An id whose first part is no folder here is still looked up."""
    from kvruntime.artifacts.bundle import locate

    monkeypatch.chdir(tmp_path)
    (tmp_path / "dir").mkdir()
    looked_up = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id: looked_up.append(repo_id) or tmp_path)
    with pytest.raises(kvruntime.ArtifactError, match="dir/bundel: no such file or folder"):
        locate("dir/bundel")
    assert looked_up == []
    assert locate("org/bundle") == tmp_path and looked_up == ["org/bundle"]


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
    refused(["bundle", str(artifact), "--out", str(model_folder)], "did not write there")
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


# Issue #48: a bundle handed to a user may be hostile, and `bundle --out` must never take a folder it did not write.


def _recorded(bundle: Path, command: str) -> Path:
    """The bundle with its artifact's recorded command replaced (the manifest only: it may say anything)."""
    manifest_path = bundle / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["artifacts"][0]["provenance"]["command"] = command
    manifest_path.write_text(json.dumps(manifest))
    return bundle


def test_reproduce_imports_no_code_from_the_current_folder(compiled, bundle, tmp_path, monkeypatch):
    """A bundle cloned from a hub with a typer.py, torch.py and kvcompile/ of its own, reproduced from inside it as
    its card says (`cd bundle && kvcompile reproduce .`): none of them runs."""
    witness = tmp_path / "PWNED"
    payload = f"open({str(witness)!r}, 'w').write('ran')\n"
    for name in ("typer.py", "torch.py", "kvcompile/__init__.py"):
        (bundle / name).parent.mkdir(exist_ok=True)
        (bundle / name).write_text(payload)
    monkeypatch.chdir(bundle)
    output = invoke(["reproduce", ".", "--model", str(compiled[0]), "--yes"])
    assert "kvcompose_stats.safetensors: reproduced" in output
    assert not witness.exists()


@pytest.mark.parametrize(
    ("command", "verdict"),
    [
        ("python -c 'import os'", "its recorded command is not one of kvcompile's compile commands"),
        ("kvcompile generate --prompt-file /etc/hostname", "its recorded command is not one of kvcompile's compile"),
        ("kvcompile stats --corpus /etc/hostname --model default", "it reads /etc/hostname, which is neither"),
        ("kvcompile stats --task-set ../../secret.txt", "it reads ../../secret.txt, which is neither"),
        ("kvcompile stats --task-set=/etc/hostname", "it reads /etc/hostname, which is neither"),
        ("kvcompile stats --model /home/someone/model", "it reads /home/someone/model, which is neither in the bundle "
         "nor shipped with kvcompile: name it with --model"),
        ("kvcompile stats --out /tmp/elsewhere.safetensors", "its recorded command names where to write (--out)"),
        ("kvcompile stats --resume", "its recorded command names where to write (--resume)"),
        ("kvcompile stats --help", "its recorded command has a word stats does not take (--help)"),
        ("kvcompile stats --prompts", "its recorded command gives --prompts no value"),
        ("kvcompile stats 'unclosed", "its recorded command is not a command line"),
    ],
)  # fmt: skip
def test_reproduce_runs_only_compile_commands_whose_inputs_are_the_bundles_or_named(bundle, command, verdict):
    result = runner.invoke(cli.app, ["reproduce", str(_recorded(bundle, command)), "--yes"])
    assert result.exit_code == 1, result.output  # nothing was reproduced
    assert f"kvcompose_stats.safetensors: not reproducible: {verdict}" in result.output
    assert "--out <scratch>" not in result.output  # nothing shown to run, nothing ran


def test_a_recorded_input_resolves_to_the_bundles_file_or_kvcompiles_shipped_data(bundle):
    from kvcompile.bundle import rerun_arguments
    from kvcompile.shipped import shipped_folder

    read = read_bundle(bundle)
    commands = cli.compile_commands()
    task_set = "calibration_data/tasks/reading_questions.txt"
    arguments = rerun_arguments(f"kvcompile stats --task-set {task_set} --seed 0", read, commands, {})
    shipped = shipped_folder("calibration_data") / "tasks" / "reading_questions.txt"
    assert arguments == ["stats", "--task-set", str(shipped), "--seed", "0"]
    heads = "artifacts/m/kvcompose_stats.safetensors"  # recorded where it was compiled: the bundle holds its copy
    for name in ("layer-errors", "budgets"):  # the command as named now, and before issue #65 (older bundles record it)
        arguments = rerun_arguments(f"kvcompile {name} --heads={heads} --corpus austen", read, commands, {})
        assert arguments == [name, f"--heads={bundle.resolve() / 'kvcompose_stats.safetensors'}", "--corpus", "austen"]
    named = {"corpus": "/data/mine.txt", "model": None}
    assert rerun_arguments("kvcompile stats --corpus mine.txt", read, commands, named)[-1] == "/data/mine.txt"


def test_reproduce_shows_its_commands_and_runs_none_when_not_confirmed(compiled, bundle, monkeypatch):
    monkeypatch.setattr(cli_artifacts, "can_ask", lambda: True)  # a terminal: the runner's input answers
    result = runner.invoke(cli.app, ["reproduce", str(bundle), "--model", str(compiled[0])], input="n\n")
    assert result.exit_code == 0, result.output
    assert "kvcompose_stats.safetensors: kvcompile stats --ratios 0.5,0.75" in result.output
    assert f"--model {compiled[0]}" in result.output and "Run these commands?" in result.output
    assert result.output.strip().endswith("nothing run") and "reproduced" not in result.output


def test_a_manifest_holding_an_escape_sequence_is_refused_never_printed(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["created"] = "\x1b]0;owned\x07 today"
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    result = runner.invoke(cli.app, ["info", str(bundle)])
    assert result.exit_code == 2 and "\x1b" not in result.output
    assert "malformed manifest (created is not a line of printable text)" in result.output


def test_bundle_out_replaces_its_own_bundle_and_nothing_else(compiled, bundle, tmp_path, monkeypatch):
    source = str(compiled[1])
    invoke(["bundle", source, "--out", str(bundle)])  # its own, unchanged: replaced
    assert read_bundle(bundle).entries[0]["file"] == "kvcompose_stats.safetensors"

    clone = tmp_path / "clone"  # a git clone of a bundle: the bundle's files, .git and a licence
    shutil.copytree(bundle, clone)
    (clone / ".git").mkdir()
    (clone / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (clone / "LICENSE").write_text("the publisher's licence\n")
    users = tmp_path / "extension"  # a folder of the user's files that happens to hold a manifest.json
    (users / "src").mkdir(parents=True)
    (users / "src" / "main.js").write_text("code\n")
    (users / "manifest.json").write_text('{"name": "extension"}\n')
    edited = tmp_path / "edited"  # its own bundle, whose card the user edited
    shutil.copytree(bundle, edited)
    (edited / "README.md").write_text("my notes\n")
    for folder in (clone, users, edited):
        before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        refused(["bundle", source, "--out", str(folder)], "did not write there (or that changed since)")
        assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before

    link = tmp_path / "link"
    link.symlink_to(bundle)
    refused(["bundle", source, "--out", str(link)], "is a symbolic link")
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    refused(["bundle", source, "--out", "."], "--out . holds the current folder")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging, no stale link


def test_a_published_run_record_holds_no_local_absolute_path(compiled, tmp_path):
    """A run record names this machine's folders (an --out, merged shards): the bundle publishes file names."""
    source = tmp_path / "compiled" / compiled[1].name
    source.parent.mkdir()
    shutil.copyfile(compiled[1], source)
    record = {"command_line": "kvcompile stats --out /home/me/secret/kvcompose_stats.safetensors --out=/home/me/x",
              "merged_from": ["/home/me/secret/a.safetensors", "b.safetensors"], "run_of": source.name}  # fmt: skip
    source.with_suffix(".run.json").write_text(json.dumps(record))
    invoke(["bundle", str(source), "--out", str(tmp_path / "b")])
    expected = {"command_line": "kvcompile stats --out kvcompose_stats.safetensors --out=x",
                "merged_from": ["a.safetensors", "b.safetensors"], "run_of": source.name}  # fmt: skip
    assert json.loads((tmp_path / "b" / "kvcompose_stats.run.json").read_text()) == expected
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["artifacts"][0]["run"] == expected


def _tuned_defaults(model_folder: Path, path: Path, names: list[str]) -> Path:
    """A tuned_defaults artifact for the tiny model recommending kvcompose with the artifacts `names`."""
    recommended = {"method": "kvcompose", "options": {}, "ratio": 0.5, "accuracy": 0.9, "artifacts": names}
    artifact = kvruntime.Artifact(
        "tuned_defaults",
        {
            "full_accuracy": torch.tensor([0.9]),
            "ratios": torch.tensor([0.25, 0.5]),
            "accuracy": torch.tensor([[0.9, 0.9]]),
        },
        kvruntime.model_fingerprint(kvruntime.load_model(str(model_folder))[0]),
        {"command": "test"},
        {"tolerance": 0.02, "recommended": recommended, "methods": ["kvcompose"]},
    )
    save_artifact(artifact, path)
    return path


@pytest.mark.parametrize("name", ["../kvcompose_stats.safetensors", "/etc/hostname", "sub/x.safetensors", ".."])
def test_a_tuned_default_naming_a_file_outside_its_folder_is_refused(compiled, tmp_path, name):
    model_folder, _ = compiled
    tuned = _tuned_defaults(model_folder, tmp_path / "t" / "tuned_defaults.safetensors", [name])
    model, _ = kvruntime.load_model(str(model_folder))
    with pytest.raises(kvruntime.ArtifactError, match="its recommendation names a file outside its folder"):
        with kvruntime.compress(model, artifacts=[tuned]):
            pass


def test_a_bundled_tuned_default_applies_only_files_its_manifest_lists(compiled, tmp_path):
    model_folder, artifact = compiled
    folder = tmp_path / "sources"
    folder.mkdir()
    _tuned_defaults(model_folder, folder / "tuned_defaults.safetensors", [artifact.name])
    invoke(["bundle", str(folder / "tuned_defaults.safetensors"), "--out", str(tmp_path / "b")])
    shutil.copyfile(artifact, tmp_path / "b" / artifact.name.replace(".safetensors", ".bin"))
    model, _ = kvruntime.load_model(str(model_folder))
    with pytest.raises(kvruntime.ArtifactError, match="names kvcompose_stats.safetensors, which its bundle does not"):
        with kvruntime.compress(model, artifacts=[tmp_path / "b"]):
            pass
    invoke(["bundle", str(folder / "tuned_defaults.safetensors"), str(artifact), "--out", str(tmp_path / "b2")])
    with kvruntime.compress(model, artifacts=[tmp_path / "b2"]) as session:  # listed: applied
        session.prefill(torch.randint(3, 96, (1, 64), generator=torch.Generator().manual_seed(0)))
    assert session.report.method == "kvcompose"


# Issue #50: every verdict of reproduce, --only, and what the card says of the base model and the results.


def test_reproduce_says_when_a_rerun_command_failed(compiled, bundle):
    recorded = read_bundle(bundle).entries[0]["provenance"]["command"]
    assert "--prompts 2" in recorded
    failing = _recorded(bundle, recorded.replace("--prompts 2", "--prompts 0"))  # refused by the rerun: exit code 2
    result = runner.invoke(cli.app, ["reproduce", str(failing), "--model", str(compiled[0]), "--yes"])
    assert result.exit_code == 1, result.output
    assert "kvcompose_stats.safetensors: differs: the command failed (exit code 2)" in result.output


def test_reproduce_only_reruns_the_kinds_asked_and_says_which_carry_no_full_command(compiled, tmp_path):
    """A bundle of two kinds, one compiled before kvcompile recorded its full command: --only picks the artifacts
    reproduce looks at; the one without a command is not reproducible, and nothing is run for it."""
    model_folder, stats = compiled
    heads = tmp_path / "sources" / "srh_heads.safetensors"
    fingerprint = read_artifact(stats).model
    shutil.copytree(stats.parent, heads.parent)
    scores = {"srh_score": torch.rand(fingerprint.num_layers, fingerprint.num_query_heads)}
    old = kvruntime.Artifact("srh_heads", scores, fingerprint, {"libraries": {"torch": "2.13.0"}}, {})  # no command
    save_artifact(old, heads)
    invoke(["bundle", str(heads.parent), "--out", str(tmp_path / "two")])
    nothing = runner.invoke(cli.app, ["reproduce", str(tmp_path / "two"), "--only", "srh_heads", "--yes"])
    assert nothing.exit_code == 1  # nothing could be reproduced
    only_heads = nothing.output
    assert "srh_heads.safetensors: not reproducible: compiled before kvcompile recorded its full command" in only_heads
    assert "kvcompose_stats" not in only_heads and "--out <scratch>" not in only_heads
    only_stats = invoke(["reproduce", str(tmp_path / "two"), "--only", "kvcompose_stats", "--model", str(model_folder),
                         "--yes"])  # fmt: skip
    assert "kvcompose_stats.safetensors: reproduced" in only_stats and "srh_heads" not in only_stats


def test_the_card_names_the_base_model_given_or_guessed_and_carries_the_results_given(
    compiled, bundle, tmp_path, monkeypatch
):
    from kvcompile.bundle import guess_base_model

    card = (bundle / "README.md").read_text()  # compiled from a local folder: no hub id to name, no results
    assert "base_model:" not in card and read_bundle(bundle).manifest["base_model"] is None
    assert "None carried: this bundle holds no tuned_defaults artifact and was given no eval results." in card
    out = tmp_path / "named"
    invoke(
        ["bundle", str(compiled[1]), "--out", str(out), "--base-model", "org/tiny-llama", "--results", str(EVAL_RUN)]
    )
    card = (out / "README.md").read_text()
    assert card.startswith("---\nbase_model: org/tiny-llama\n") and read_bundle(out).manifest["base_model"] == (
        "org/tiny-llama"
    )
    assert "## Measured results" in card and "| distilled | 0.9 | " in card and "None carried" not in card

    def compiled_by(command: str) -> object:
        return kvruntime.Artifact("srh_heads", {}, None, {"command": command}, {})

    assert guess_base_model([compiled_by("kvcompile heads --lengths 320")]) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert guess_base_model([compiled_by("kvcompile heads --model gemma-3-270m")]) == "google/gemma-3-270m"
    assert guess_base_model([compiled_by("kvcompile heads --model org/model-id")]) == "org/model-id"
    assert guess_base_model([compiled_by(f"kvcompile heads --model {compiled[0]}")]) is None
    monkeypatch.chdir(compiled[0].parent.parent)  # a local folder named as `folder/model` has a hub id's shape
    assert guess_base_model([compiled_by(f"kvcompile heads --model {compiled[0].parent.name}/model")]) is None


def test_a_hub_id_that_is_not_in_the_local_cache_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    refused(
        ["info", "someone/absent-bundle"],
        "someone/absent-bundle: no such file or folder, and no hub repo of that id in the local Hugging Face cache",
    )


def test_reproduce_reruns_a_command_that_writes_a_companion_once_and_compares_both_files(compiled, tmp_path):
    """`kvcompile tables` writes its experience beside the tables: both carry the command, the bundle holds both, and
    reproduce reruns the command once and judges each file."""
    model_folder = compiled[0]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(chr(97 + (j * j * 13) % 26) for j in range(6000)))
    tables = tmp_path / "sources" / "compilerkv_tables.safetensors"
    invoke(["tables", *TABLES, "--model", str(model_folder), "--corpus", str(corpus), "--out", str(tables)])
    experience = tables.with_name("compilerkv_tables.experience.safetensors")
    commands = {read_artifact(path).provenance.get("command") for path in (tables, experience)}
    assert len(commands) == 1 and None not in commands
    invoke(["bundle", str(tables), str(experience), "--out", str(tmp_path / "bundle")])
    output = invoke(["reproduce", str(tmp_path / "bundle"), "--model", str(model_folder), "--corpus", str(corpus),
                     "--yes"])  # fmt: skip
    assert output.count("--out <scratch>") == 1  # one command shown and run for the two files
    assert "compilerkv_tables.safetensors: reproduced" in output
    assert "compilerkv_tables.experience.safetensors: reproduced" in output


# Issue #52: a bundle carries an eval run's measured table.
SHIPPED = Path(__file__).resolve().parent.parent / "artifacts" / "smollm2-135m-instruct"
EVAL_RUN = Path(__file__).resolve().parent.parent / "benchmarks" / "distilled" / "runs" / "eval_share_floor"


def test_a_bundle_of_the_shipped_scorer_carries_an_eval_runs_table_into_its_manifest_card_and_info(tmp_path):
    import csv

    out = tmp_path / "bundle"
    invoke(["bundle", str(SHIPPED / "distilled_scorer.safetensors"), "--out", str(out), "--results", str(EVAL_RUN)])
    results = json.loads((out / "manifest.json").read_text())["results"]
    # The table is the run's own summary (its summary.csv, written by the eval), method by method and ratio by ratio.
    with open(EVAL_RUN / "summary.csv") as handle:
        summary = {(r["method"], float(r["ratio"])): r for r in csv.DictReader(handle)}
    table = {(r["method"], r["ratio"]): r for r in results["table"]}
    assert table.keys() == summary.keys() and len(table) == 1 + 3 * 3
    for key, row in table.items():
        for column in ("accuracy", "answer_kl", "answer_logprob", "cache_kept"):
            assert row[column] == pytest.approx(float(summary[key][column]), abs=1e-3), (key, column)
    assert results["prompts"] == 36 and results["question_aware"] is False
    assert (
        results["source"].startswith("kvcompile's suite: tasks passkey, passkey_prose")
        and "seed 10" in results["source"]
    )
    assert results["command"].startswith("kvcompile eval --model default --methods full,distilled,distilled:floor=0.5")
    assert (out / results["picture"]).read_bytes() == (EVAL_RUN / "accuracy_vs_ratio.png").read_bytes()
    card = (out / "README.md").read_text()
    assert "| distilled\\:floor\\=0\\.5 | 0.75 | " in card and f"Rerun: `{results['command']}`" in card
    assert "![accuracy against the bytes removed](eval\\_accuracy\\_vs\\_ratio\\.png)" in card
    assert "None carried" not in card
    shown = invoke(["info", str(out)])
    assert "measured results:" in shown and "36 prompts of kvcompile's suite" in shown
    assert "| distilled | 0.9 | " in shown


def _record(prompt: int, method: str, ratio: float, correct: int, kl: float, logprob: float, kept: float) -> dict:
    return {"prompt": prompt, "method": method, "ratio": ratio, "correct": correct, "kl": kl / 2, "answer_kl": kl,
            "answer_logprob": logprob, "agreement": 1.0, "cache_kept": kept, "prefill_vs_full": 1.0, "peak_mib": None,
            "task": "passkey", "length": 1024, "depth": 0.5}  # fmt: skip


def test_the_published_table_is_the_means_of_a_hand_written_run(tmp_path):
    """Two prompts, the full cache and snapkv at 0.5, the means worked by hand; the picture carried only as a plain
    file of at most 8 MiB."""
    from kvcompile.evaluation.published import PICTURE_MAX_BYTES, eval_results

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"tasks": ["passkey"], "lengths": ["1k"], "seed": 3}))
    records = [
        _record(0, "full", 0.0, 1, 0.0, -1.0, 1.0),
        _record(1, "full", 0.0, 0, 0.0, -3.0, 1.0),
        _record(0, "snapkv", 0.5, 1, 0.25, -2.0, 0.5),
        _record(1, "snapkv", 0.5, 0, 0.75, -5.0, 0.52),
    ]
    (run / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "results.md").write_text("# Results\n\nCommand: `kvcompile eval --methods snapkv --ratios 0.5`  \n")
    results = eval_results(run)
    assert results["table"] == [
        # accuracy (1 + 0) / 2; answer KL (0.25 + 0.75) / 2; log-probability (-2 - 5) / 2; bytes (0.5 + 0.52) / 2
        {"method": "full", "ratio": 0.0, "accuracy": 0.5, "answer_kl": 0.0, "answer_logprob": -2.0, "cache_kept": 1.0},
        {"method": "snapkv", "ratio": 0.5, "accuracy": 0.5, "answer_kl": 0.5, "answer_logprob": -3.5,
         "cache_kept": 0.51},
    ]  # fmt: skip
    assert results["prompts"] == 2 and results["question_aware"] is False
    assert results["source"] == "kvcompile's suite: tasks passkey; lengths 1k; seed 3"
    assert results["command"] == "kvcompile eval --methods snapkv --ratios 0.5" and "picture" not in results
    (tmp_path / "elsewhere.png").write_bytes(b"\x89PNG")
    (run / "accuracy_vs_ratio.png").symlink_to(tmp_path / "elsewhere.png")
    assert "picture" not in eval_results(run)  # a link may point anywhere: never carried
    (run / "accuracy_vs_ratio.png").unlink()
    (run / "accuracy_vs_ratio.png").write_bytes(b"\0" * (PICTURE_MAX_BYTES + 1))
    assert "picture" not in eval_results(run)
    (run / "accuracy_vs_ratio.png").write_bytes(b"\0" * PICTURE_MAX_BYTES)
    assert eval_results(run)["picture"] == "eval_accuracy_vs_ratio.png"


GOOD_RESULTS = {"source": "kvcompile's suite", "prompts": 2, "command": "kvcompile eval", "picture": "eval_a.png",
                "table": [{"method": "full", "ratio": 0.0, "accuracy": 1, "note": None}]}  # fmt: skip


@pytest.mark.parametrize(
    "results, problem",
    [
        ([GOOD_RESULTS], "its results are not an object"),
        ({**GOOD_RESULTS, "source": None}, "its results need a source and a count of prompts"),
        ({**GOOD_RESULTS, "source": "a\x1b[2Jb"}, "its results need a source and a count of prompts"),
        ({**GOOD_RESULTS, "prompts": -1}, "its results need a source and a count of prompts"),
        ({**GOOD_RESULTS, "prompts": True}, "its results need a source and a count of prompts"),
        ({**GOOD_RESULTS, "prompts": 2.0}, "its results need a source and a count of prompts"),
        ({**GOOD_RESULTS, "command": ["kvcompile"]}, "its results' command is not a line of printable text"),
        ({**GOOD_RESULTS, "picture": "../x.png"}, "its results' picture is not a file name in the bundle"),
        ({**GOOD_RESULTS, "picture": ".."}, "its results' picture is not a file name in the bundle"),
        ({**GOOD_RESULTS, "picture": "a\\b.png"}, "its results' picture is not a file name in the bundle"),
        ({**GOOD_RESULTS, "table": {"method": "full"}}, "its results' table is not a list of rows"),
        ({**GOOD_RESULTS, "table": [["full", 0.0]]}, "its results' table is not a list of rows"),
        ({**GOOD_RESULTS, "table": [{"accuracy": float("nan")}]}, "its results' table holds a cell"),
        ({**GOOD_RESULTS, "table": [{"accuracy": float("inf")}]}, "its results' table holds a cell"),
        ({**GOOD_RESULTS, "table": [{"accuracy": True}]}, "its results' table holds a cell"),
        ({**GOOD_RESULTS, "table": [{"accuracy": [1]}]}, "its results' table holds a cell"),
        ({**GOOD_RESULTS, "table": [{"a\nb": 1}]}, "its results' table holds a cell"),
    ],
)
def test_each_way_results_can_be_malformed_is_named(results, problem):
    from kvruntime.artifacts.bundle import results_problem

    assert results_problem(GOOD_RESULTS) is None
    assert results_problem({**GOOD_RESULTS, "command": None, "table": []}) is None
    assert (results_problem(results) or "").startswith(problem)


def _eval_run(tmp_path: Path, edit) -> Path:
    folder = tmp_path / "run"
    shutil.copytree(EVAL_RUN, folder)
    edit(folder)
    return folder


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda f: (f / "run.json").unlink(), "cannot bundle the eval results in"),
        (lambda f: (f / "runs.jsonl").write_text('{"prompt": 0, "method": "full", "ratio": 0, "correct": "yes"}\n'),
         "line 1 is not a run record (its correct is missing or not a number)"),
        (lambda f: (f / "runs.jsonl").write_text((EVAL_RUN / "runs.jsonl").read_text().replace('"answer_kl": 0.0,', '"answer_kl": NaN,', 1)),
         "a number that is not finite"),
        (lambda f: (f / "runs.jsonl").write_text("\n".join(line for line in (EVAL_RUN / "runs.jsonl").read_text().splitlines() if '"method": "full"' not in line)),
         "its records hold no full cache's"),
    ],
)  # fmt: skip
def test_an_eval_folder_that_is_not_a_run_is_refused_in_one_line(tmp_path, edit, message):
    refused(
        [
            "bundle",
            str(SHIPPED / "srh_heads.safetensors"),
            "--out",
            str(tmp_path / "b"),
            "--results",
            str(_eval_run(tmp_path, edit)),
        ],
        message,
    )
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda r: r.update(picture="../../etc/passwd"), "its results' picture is not a file name in the bundle"),
        (lambda r: r["table"][0].update(method="\x1b]0;owned\x07"), "its results' table holds a cell"),
        (lambda r: r.update(command="kvcompile eval\nrm -rf ~"), "its results' command is not a line of printable"),
        (lambda r: r.update(prompts=True), "its results need a source and a count of prompts"),
    ],
)
def test_a_manifest_whose_results_are_not_results_is_refused_never_printed(tmp_path, edit, problem):
    out = tmp_path / "bundle"
    invoke(["bundle", str(SHIPPED / "srh_heads.safetensors"), "--out", str(out), "--results", str(EVAL_RUN)])
    manifest = json.loads((out / "manifest.json").read_text())
    edit(manifest["results"])
    (out / "manifest.json").write_text(json.dumps(manifest))
    result = runner.invoke(cli.app, ["info", str(out)])
    assert result.exit_code == 2 and "\x1b" not in result.output
    assert f"malformed manifest ({problem}" in result.output


# Issue #61: a refused bundle run keeps the good bundle; nothing from a record reaches the card as markup.
def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _hostile_eval_run(tmp_path: Path, method: str) -> Path:
    """The shipped eval run with one method renamed `method` in its records and settings."""
    folder = tmp_path / "hostile_run"
    shutil.copytree(EVAL_RUN, folder)
    runs = (EVAL_RUN / "runs.jsonl").read_text().replace('"method": "distilled"', json.dumps({"method": method})[1:-1])
    (folder / "runs.jsonl").write_text(runs)
    return folder


@pytest.mark.parametrize(
    "extra, message",
    [
        (lambda d: ["--base-model", "x/y\nlicense: evil\n---"], "--base-model 'x/y\\nlicense: evil\\n---': give the"),
        (lambda d: ["--base-model", "<img src=x>"], "give the model's hub repo id (org/name)"),
        (lambda d: ["--results", str(_hostile_eval_run(d, "distilled\x1b]0;owned\x07"))],
         "its results' table holds a cell that is not text"),
        (lambda d: ["--results", "/etc/passwd"], "--results /etc/passwd: not a folder"),
        (lambda d: ["--results", str(EVAL_RUN / "results.md")], "not a folder (give the --out folder of a kvcompile eval"),
    ],
)  # fmt: skip
def test_a_refused_bundle_run_leaves_the_good_bundle_byte_for_byte(tmp_path, extra, message):
    out = tmp_path / "bundle"
    invoke(["bundle", str(SHIPPED / "srh_heads.safetensors"), "--out", str(out)])
    before = _snapshot(out)
    result = runner.invoke(
        cli.app, ["bundle", str(SHIPPED / "srh_heads.safetensors"), "--out", str(out), *extra(tmp_path)]
    )
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1 and "\x1b" not in result.output
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging folder left
    read_bundle(out)


def test_a_manifest_the_reader_would_refuse_is_never_put_in_place(tmp_path, monkeypatch):
    """The last guard: should a value slip past the checks at the edge, the staged bundle is read back before it
    replaces the good one."""
    from kvcompile import bundle as bundle_module

    out = tmp_path / "bundle"
    invoke(["bundle", str(SHIPPED / "srh_heads.safetensors"), "--out", str(out)])
    before = _snapshot(out)
    monkeypatch.setattr(bundle_module, "check_base_model", lambda base: None)
    monkeypatch.setattr(bundle_module, "manifest_problem", lambda manifest: None)
    result = runner.invoke(
        cli.app, ["bundle", str(SHIPPED / "srh_heads.safetensors"), "--out", str(out), "--base-model", "x\ny"]
    )
    assert result.exit_code == 2 and "malformed manifest (base_model is not a line of printable text)" in result.output
    assert _snapshot(out) == before


HOSTILE = [
    "<img src=x onerror=alert(1)>",
    "<iframe src=//evil>",
    "<script>alert(1)</script>",
    "[x](javascript:alert(1))",
]


def _rendered_text(markdown: str) -> str:
    """What a reader of the rendered card sees (CommonMark with tables, markdown-it: an independent renderer)."""
    import html

    from markdown_it import MarkdownIt

    rendered = MarkdownIt("commonmark").enable("table").render(markdown)
    tags = set(re.findall(r"</?([a-zA-Z][\w-]*)", rendered))
    assert tags <= {"p", "h1", "h2", "table", "thead", "tbody", "tr", "th", "td", "code", "pre", "img", "hr"}, tags
    return html.unescape(rendered)


@pytest.mark.parametrize("value", HOSTILE)
def test_text_from_a_record_renders_as_itself_never_as_markup(value):
    from kvcompile.markdown import markdown_code, markdown_text

    assert _rendered_text(markdown_text(value)) == f"<p>{value}</p>\n"
    assert _rendered_text(f"| a |\n| --- |\n| {markdown_code(value + ' | `x`')} |").count("<code>") == 1


def test_no_card_holds_raw_html_or_a_link_from_a_record(tmp_path):
    """Method names, the suite's name, its scoring and tasks from an eval folder's records, and an artifact's
    recorded command and calibration data, all hostile: the card shows each as text."""
    run = tmp_path / "run"
    shutil.copytree(EVAL_RUN, run)
    settings = json.loads((run / "run.json").read_text())
    settings.update(suite=f"/x/{HOSTILE[3]}", suite_sha256=HOSTILE[1], scoring=HOSTILE[2])
    (run / "run.json").write_text(json.dumps(settings))
    runs = (
        (EVAL_RUN / "runs.jsonl").read_text().replace('"method": "distilled"', json.dumps({"method": HOSTILE[0]})[1:-1])
    )
    (run / "runs.jsonl").write_text(runs)
    artifact = read_artifact(SHIPPED / "srh_heads.safetensors")
    artifact.provenance.update(command=f"kvcompile heads {HOSTILE[1]}", calibration_data=HOSTILE[3])
    source = tmp_path / "src" / "srh_heads.safetensors"
    save_artifact(artifact, source)
    invoke(["bundle", str(source), "--out", str(tmp_path / "b"), "--results", str(run)])
    card = (tmp_path / "b" / "README.md").read_text()
    from markdown_it import MarkdownIt

    rendered = MarkdownIt("commonmark").enable("table").render(card.split("---\n", 2)[2])
    shown = _rendered_text(card.split("---\n", 2)[2])  # the markup the renderer makes is only the card's own
    for value in HOSTILE:  # shown as the text it is, never as markup (no tag of its, no link: _rendered_text)
        assert value in shown and (value not in rendered or not value.startswith("<"))
    assert "href" not in rendered
