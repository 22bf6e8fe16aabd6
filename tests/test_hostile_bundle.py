"""Issue #73, an outside probe of `bundle`, `reproduce`, `info` and `merge`: an interrupt never loses the bundle at
--out, one folder spelled two ways takes one lock, no file is read through a link (or as a FIFO or a device), an
eval folder's records are read bounded, crafted partial statistics and manifests are refused in one line, and text
from a file reaches the terminal escaped. Tiny fabricated inputs around the shipped artifacts: no model is loaded."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from test_bundle import invoke, refused
from typer.testing import CliRunner

import kvruntime
from kvcompile import bundle as bundle_module
from kvcompile import cli
from kvcompile.evaluation import published  # noqa: F401  imported before a test times `bundle --results`
from kvruntime.artifacts import artifact_header
from kvruntime.artifacts import bundle as runtime_bundle
from kvruntime.artifacts.artifact import check_artifact_matches_model, read_artifact, save_artifact
from kvruntime.artifacts.bundle import read_bundle
from kvruntime.artifacts.fingerprint import ModelFingerprint
from kvruntime.files import path_lock

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "artifacts" / "smollm2-135m-instruct"
EVAL_RUN = ROOT / "benchmarks" / "distilled" / "runs" / "eval_share_floor"
HEADS = str(SHIPPED / "srh_heads.safetensors")
BUDGETS = str(SHIPPED / "layer_budgets.safetensors")


def _files(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def _leftovers(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.name.startswith("."))


# 1. An interrupt at any point of `bundle --out <a bundle>` leaves a good bundle there.


def _good_bundle(out: Path) -> list[str]:
    """The files of the complete bundle at `out` (read back and unchanged since `bundle` wrote it)."""
    read_bundle(out)
    assert bundle_module.is_written_bundle(out), _files(out)
    return _files(out)


def test_every_interrupt_point_of_bundle_leaves_a_good_bundle_at_out(tmp_path, monkeypatch):
    """Ctrl-C at each os.replace and shutil.rmtree of a run in turn (the renames and removals that swap the
    folders): --out holds the old bundle or the new one, whole; the next run clears what was left beside it."""
    out = tmp_path / "bundle"
    invoke(["bundle", HEADS, "--out", str(out)])
    old = _good_bundle(out)
    assert "srh_heads.run.json" in old and "srh_heads.png" in old  # its companions come along
    calls = {"count": 0, "interrupt_at": 0}
    real_replace, real_rmtree = os.replace, shutil.rmtree

    def interruptible(real):
        def call(*args, **kwargs):
            calls["count"] += 1
            if calls["count"] == calls["interrupt_at"]:
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(os, "replace", interruptible(real_replace))
    monkeypatch.setattr(shutil, "rmtree", interruptible(real_rmtree))
    seen = set()
    for point in range(1, 50):
        calls.update(count=0, interrupt_at=point)
        result = runner.invoke(cli.app, ["bundle", HEADS, BUDGETS, "--out", str(out)])
        assert result.exit_code in (0, 130), result.output
        seen.add(tuple(_good_bundle(out)))
        if calls["count"] < point:  # the run ended before this point: every point was tried
            break
        calls["interrupt_at"] = 0
        invoke(["bundle", HEADS, "--out", str(out)])  # the old bundle again for the next point
    else:
        pytest.fail("bundle made more calls than expected")
    assert point > 3 and tuple(old) in seen and len(seen) == 2  # interrupted early (old kept) and late (new in place)
    monkeypatch.undo()
    invoke(["bundle", HEADS, "--out", str(out)])
    assert _leftovers(tmp_path) == []


def test_an_old_bundle_a_killed_run_set_aside_is_put_back_by_the_next_run(tmp_path, monkeypatch):
    """Killed (SIGKILL) between the two renames: --out is missing and the old bundle lies beside it. The next run
    puts it back before it writes; interrupted while writing, it leaves that old bundle at --out."""
    out = tmp_path / "bundle"
    invoke(["bundle", HEADS, "--out", str(out)])
    old = _good_bundle(out)
    os.replace(out, tmp_path / ".bundle.stale-0badc0de")
    (tmp_path / ".bundle.partial-killed").mkdir()
    (tmp_path / ".bundle.partial-killed" / "half.safetensors").write_bytes(b"\0")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "copyfileobj", interrupted)  # Ctrl-C while the new bundle is being written
    result = runner.invoke(cli.app, ["bundle", HEADS, BUDGETS, "--out", str(out)])
    assert result.exit_code == 130, result.output
    assert _good_bundle(out) == old and _leftovers(tmp_path) == []


# 2. The lock is taken on the folder written, however it is spelled.


def test_two_runs_into_one_folder_spelled_two_ways_take_one_lock(tmp_path):
    real = tmp_path / "real"
    (tmp_path / "x").mkdir()
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    for spelled in (tmp_path / "link" / "b2", tmp_path / "x" / ".." / "real" / "b2"):
        with path_lock(real / "b2", wait=False):
            refused(["bundle", HEADS, "--out", str(spelled)], "another run is writing")
    assert not (real / "b2").exists()


# 3. No file is read through a link, nor as a FIFO or a device.


def _artifact_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "compiled"
    folder.mkdir()
    shutil.copyfile(HEADS, folder / "srh_heads.safetensors")
    return folder


@pytest.mark.parametrize(
    "name, make, message",
    [
        ("srh_heads.png", lambda path, private: path.symlink_to(private), "srh_heads.png is a symbolic link"),
        ("srh_heads.run.json", lambda path, private: path.symlink_to(private), "srh_heads.run.json is a symbolic"),
        ("srh_heads.png", lambda path, private: os.mkfifo(path), "srh_heads.png is not a regular file"),
        ("srh_heads.run.json", lambda path, private: os.mkfifo(path), "srh_heads.run.json is not a regular file"),
        ("srh_heads.safetensors", lambda path, private: path.symlink_to(HEADS), "srh_heads.safetensors is a symbolic"),
    ],
    ids=["picture-link", "run-record-link", "picture-fifo", "run-record-fifo", "artifact-link"],
)
def test_an_artifacts_companion_that_is_a_link_or_not_a_file_is_refused_never_copied(tmp_path, name, make, message):
    folder = _artifact_folder(tmp_path)
    private = tmp_path / "private.txt"
    private.write_text('{"run_of": "x", "secret": "my private key"}')
    (folder / name).unlink(missing_ok=True)
    make(folder / name, private)
    refused(["bundle", str(folder), "--out", str(tmp_path / "b")], message)
    assert not (tmp_path / "b").exists() and _leftovers(tmp_path) == []


def test_a_bundles_manifest_or_file_that_is_a_link_is_refused(tmp_path):
    out = tmp_path / "bundle"
    invoke(["bundle", HEADS, "--out", str(out)])
    manifest = out / "manifest.json"
    manifest.rename(tmp_path / "manifest.json")
    manifest.symlink_to("/dev/zero")
    refused(["info", str(out)], "manifest.json: not a readable manifest (")
    manifest.unlink()
    manifest.symlink_to(tmp_path / "manifest.json")
    refused(["info", str(out)], "manifest.json is a symbolic link: only a plain file is read")
    manifest.unlink()
    os.mkfifo(manifest)
    refused(["info", str(out)], "manifest.json is not a regular file")


@pytest.mark.parametrize("methods", ["distilled:artifacts=/etc", "distilled:artifacts=../../x", "full,snapkv:x=~/y"])
def test_reproduce_never_follows_an_absolute_path_or_dotdot_inside_a_recorded_value(tmp_path, methods):
    """A tune command recorded with `--methods distilled:artifacts=/abs`: not reproducible, nothing run."""
    out = tmp_path / "bundle"
    invoke(["bundle", HEADS, "--out", str(out)])
    command = f"kvcompile tune --methods {methods} --model default"
    with pytest.raises(bundle_module.NotReproducible, match="which is neither in the bundle nor shipped"):
        bundle_module.rerun_arguments(command, read_bundle(out), cli.compile_commands(), {})
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["artifacts"][0]["provenance"]["command"] = command
    (out / "manifest.json").write_text(json.dumps(manifest))
    result = runner.invoke(cli.app, ["reproduce", str(out), "--yes"])
    assert result.exit_code == 1 and "srh_heads.safetensors: not reproducible: it reads" in result.output
    assert "--out <scratch>" not in result.output


# 4. `bundle --results` reads an eval folder's files as plain files of bounded size, their numbers of few digits.


def _eval_run(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    shutil.copytree(EVAL_RUN, folder)
    return folder


def _sparse(path: Path, size: int) -> None:
    with path.open("wb") as handle:
        handle.truncate(size)  # no block written: a large file at no cost


def _bundle_with_results(tmp_path: Path, run: Path, timeout: float = 5.0):
    """The `bundle --results` run's result, waited for at most `timeout` seconds (None if it did not end)."""
    results = []
    args = ["bundle", HEADS, "--out", str(tmp_path / "b"), "--results", str(run)]
    worker = threading.Thread(target=lambda: results.append(runner.invoke(cli.app, args)), daemon=True)
    worker.start()
    worker.join(timeout)
    return results[0] if results else None


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda path: os.mkfifo(path), "runs.jsonl is not a regular file"),
        (lambda path: path.symlink_to("/dev/zero"), "runs.jsonl is a symbolic link"),
        (lambda path: _sparse(path, (64 << 20) + 1), f"runs.jsonl holds more than {64 << 20} bytes"),
    ],
    ids=["fifo", "dev-zero", "too-large"],
)
def test_results_records_that_are_no_plain_file_of_bounded_size_are_refused_at_once(tmp_path, make, message):
    run = _eval_run(tmp_path)
    (run / "runs.jsonl").unlink()
    make(run / "runs.jsonl")
    result = _bundle_with_results(tmp_path, run)
    assert result is not None, "bundle --results did not end"
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    "key, number, digits",
    [("cache_kept", "9" * 401, 401), ("answer_kl", "0." + "1" * 60, 61), ("prompt", "1" * 51, 51)],
)
def test_a_record_with_a_number_of_hundreds_of_digits_is_refused_in_one_line(tmp_path, key, number, digits):
    run = _eval_run(tmp_path)
    lines = (run / "runs.jsonl").read_text().splitlines()
    record = json.loads(lines[1])
    record[key] = "NUMBER"
    lines[1] = json.dumps(record).replace('"NUMBER"', number)
    (run / "runs.jsonl").write_text("\n".join(lines) + "\n")
    message = f"runs.jsonl line 2 holds a number of {digits} digits"
    refused(["bundle", HEADS, "--out", str(tmp_path / "b"), "--results", str(run)], message)


def test_json_read_from_files_refuses_long_numbers_and_repeated_keys():
    assert artifact_header.load_json('{"a": [1, -2.5e-3, 12345678901234567890]}') == {
        "a": [1, -2.5e-3, 12345678901234567890]
    }
    for text, problem in [
        ("1" * 51, "a number of 51 digits"),
        ('{"a": 1, "a": 2}', "names the key 'a' twice"),
        ('{"b": {"a\\u001b": 1, "a\\u001b": 2}}', "names the key 'a\\x1b' twice"),
    ]:
        with pytest.raises(ValueError, match=problem.replace("\\", "\\\\")):
            artifact_header.load_json(text)


# 5. `merge` of crafted partial statistics.


def _partial(path: Path, params: dict, done: list[float]) -> Path:
    fingerprint = ModelFingerprint("LlamaForCausalLM", 2, 4, 2, 16, "0" * 16)
    tensors = {"items_done": torch.tensor(done, dtype=torch.float64)}
    save_artifact(kvruntime.Artifact("partial_statistics", tensors, fingerprint, {}, params), path)
    return path


@pytest.mark.parametrize(
    "params, message",
    [
        ({"statistics_of": "kvcompose_stats", "items": 2, "shards": ["0/2"]}, "(its settings are not an object)"),
        ({"settings": {}, "items": 2, "shards": ["0/2"]}, "(its statistics_of is not an artifact kind)"),
        ({"statistics_of": "kvcompose_stats", "settings": {}, "items": "2", "shards": []}, "(its items are not a"),
        ({"statistics_of": "kvcompose_stats", "settings": {}, "items": 2, "shards": "0/2"}, "(its shards are not"),
        ({"statistics_of": "kvcompose_stats", "settings": {}, "items": 3, "shards": ["0/2"]}, "(no items_done count)"),
        ({"statistics_of": "kvcompose_stats", "settings": {}, "items": 2, "shards": ["0/2"]}, "cannot be finished"),
    ],
)
def test_merge_refuses_crafted_partial_statistics_in_one_line(tmp_path, params, message):
    first = _partial(tmp_path / "a.safetensors", params, [1.0, 0.0])
    second = _partial(tmp_path / "b.safetensors", params, [0.0, 1.0])
    refused(["merge", str(first), str(second), "--out", str(tmp_path / "m.safetensors")], message)
    assert not (tmp_path / "m.safetensors").exists()


# 6. Text from a file reaches the terminal escaped.

HOSTILE_ARCHITECTURE = "Llama\x1b[2J\x1b]0;title\x07"


def test_info_and_the_another_model_error_show_a_files_control_characters_escaped(tmp_path):
    artifact = read_artifact(HEADS)
    hostile = dataclasses.replace(artifact.model, architecture=HOSTILE_ARCHITECTURE, weights_hash="\x9b31m\x7f")
    path = tmp_path / "srh_heads.safetensors"
    save_artifact(dataclasses.replace(artifact, model=hostile), path)
    shown = invoke(["info", str(path)])
    assert "\x1b" not in shown and "\x07" not in shown and "\x9b" not in shown and "\x7f" not in shown
    assert "model: Llama\\x1b[2J\\x1b]0;title\\x07, " in shown and "weights \\x9b31m\\x7f" in shown
    with pytest.raises(kvruntime.ArtifactError) as refusal:
        check_artifact_matches_model(
            read_artifact(path), dataclasses.replace(hostile, architecture="Qwen2", head_dim=8)
        )
    assert "\x1b" not in str(refusal.value) and "architecture: Llama\\x1b[2J\\x1b]0;title\\x07 vs Qwen2" in str(
        refusal.value
    )


# 7. A manifest listing a file many times, or naming a key twice.


def _manifest_edited(tmp_path: Path, edit) -> Path:
    out = tmp_path / "bundle"
    invoke(["bundle", HEADS, "--out", str(out)])
    manifest = json.loads((out / "manifest.json").read_text())
    text = edit(manifest)
    (out / "manifest.json").write_text(text if isinstance(text, str) else json.dumps(manifest))
    return out


def _listed_many_times(times: int):
    def edit(manifest: dict) -> None:
        entry = {key: manifest["artifacts"][0][key] for key in ("file", "kind", "sha256")}
        manifest["artifacts"] = [entry] * times

    return edit


@pytest.mark.parametrize(
    "edit, message",
    [
        (_listed_many_times(20_000), "(20000 artifact entries, more than a bundle's 256)"),
        (_listed_many_times(2), "(it lists srh_heads.safetensors twice)"),
        (lambda m: json.dumps(m)[:-1] + ', "base_model": "x/y"}', "names the key 'base_model' twice"),
    ],
)
def test_a_manifest_listing_a_file_twice_or_naming_a_key_twice_is_refused(tmp_path, monkeypatch, edit, message):
    out = _manifest_edited(tmp_path, edit)
    opened = []
    real = runtime_bundle.open_plain_file
    monkeypatch.setattr(runtime_bundle, "open_plain_file", lambda path: opened.append(Path(path).name) or real(path))
    refused(["info", str(out)], message)
    assert opened == ["manifest.json"]  # refused before any listed file is read


def test_reading_a_bundle_opens_each_listed_file_once(tmp_path, monkeypatch):
    """Its bytes checked and its header read from one opening: the header read is that of the bytes checked."""
    import builtins

    out = tmp_path / "bundle"
    invoke(["bundle", HEADS, BUDGETS, "--out", str(out)])
    opened = []
    for module, name in ((os, "open"), (builtins, "open")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda path, *a, real=real, **k: opened.append(path) or real(path, *a, **k))
    read_bundle(out)
    monkeypatch.undo()
    listed = sorted(Path(path).name for path in opened if str(path).endswith(".safetensors"))
    assert listed == ["layer_budgets.safetensors", "srh_heads.safetensors"]
