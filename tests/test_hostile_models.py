"""A model folder, a GGUF file and the model cache are hostile input too (issue #73): no code of a model folder runs,
no command writes into the shipped artifacts, the dequantised cache is keyed by the weights' content and checked
on use, and missing weights are refused, never initialised at random. The refusals that need no model are in
tests/test_refusals_before_torch.py (their time in benchmarks/performance/refusal_latency.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import save_char_tokenizer, tiny_model
from safetensors.torch import load_file, save_file
from test_bundle import TABLES
from test_cli import tiny_artifact
from test_default_model_cache import tiny_spec, write_tiny_model
from test_refusals_before_torch import _custom_code_folder, gguf_bytes
from test_shipped_models import GGUF_BYTES, chunk_package
from typer.testing import CliRunner

import kvruntime
from kvcompile.cli import app
from kvcompile.recipe import artifact_folder, compiled_artifact, default_artifact, folder_identity, store_folder
from kvcompile.recipes.compresskv.recipe import HeadsRecipe
from kvruntime import read_artifact
from kvruntime.errors import KVRuntimeError
from kvruntime.files import cache_root
from kvruntime.models import default_model as dm
from kvruntime.models import model_cache, model_loading

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def tiny_folder(folder: Path) -> Path:
    tiny_model("llama").save_pretrained(folder)
    save_char_tokenizer(folder)
    return folder


# --- no code of a model folder runs --------------------------------------------------------------------------------


def test_transformers_is_never_let_run_a_folders_code_even_past_the_check(tmp_path):
    """The loader below the check, with the folder's auto_map and a "y" on stdin: transformers is called with
    trust_remote_code=False, so it loads a type it implements with its own code and refuses one it does not; the
    folder's modules never run."""
    folders = []
    for model_type in ("llama", "evil"):
        (tmp_path / model_type).mkdir()
        folder = tmp_path / model_type / _custom_code_folder(tmp_path / model_type, "config")
        tiny_folder(tmp_path / model_type / "weights")
        shutil.copy(tmp_path / model_type / "weights" / "model.safetensors", folder / "model.safetensors")
        save_char_tokenizer(folder)
        config = json.loads((tmp_path / model_type / "weights" / "config.json").read_text())
        mapping = json.loads((folder / "config.json").read_text())["auto_map"]
        (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type, "auto_map": mapping}))
        folders.append(str(folder))
    script = (
        "import sys, torch; from pathlib import Path; from kvruntime.models.model_loading import _load_folder\n"
        "for folder in sys.argv[1:]:\n"
        "    try:\n        _load_folder(Path(folder), torch.float32); print('loaded')\n"
        "    except Exception as exc:\n        print('refused:', type(exc).__name__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, *folders], input="y\n", capture_output=True, text=True, timeout=300
    )
    assert result.stdout.split("\n")[:2] == ["loaded", "refused: ValueError"], result.stdout + result.stderr[-2000:]
    assert not list(tmp_path.glob("*/ran-*"))
    with pytest.raises(KVRuntimeError, match="ships code of its own"):
        kvruntime.load_model(folders[0])  # the runtime's own entry refuses it first


# --- the shipped artifacts are read only ---------------------------------------------------------------------------


def shipped_bytes() -> dict[str, str]:
    folder = ROOT / "artifacts"
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}  # fmt: skip


COMPILE_COMMANDS = {
    "heads": ["--lengths", "256", "--depths", "0.5", "--prompt-format", "raw"],
    "layer-errors": ["--prompts", "1", "--prompt-tokens", "64", "--new-tokens", "2"],
    "stats": ["--prompts", "2", "--prompt-tokens", "64", "--ratios", "0.5"],
    "distill": ["--prompts", "4", "--prompt-tokens", "64", "--lookahead-steps", "4", "--lookahead-prompts", "2"],
    "tables": TABLES,
    "tune": ["--methods", "snapkv", "--ratios", "0.5", "--tasks", "passkey", "--lengths", "256", "--samples", "1",
             "--prompt-format", "raw"],
}  # fmt: skip


@pytest.mark.integration
def test_every_compile_command_on_a_model_named_like_a_shipped_one_leaves_the_shipped_artifacts_alone(
    tmp_path, monkeypatch, short_cql_fits
):
    """The probe's case: `stats --model <P>/x/smollm2-135m-instruct` overwrote the default model's shipped
    statistics. Each compile command now writes into the store, in a folder of that model's own. (A random tiny
    model answers no needle probe, so `heads`' measurement is replaced by a fixed score: what it measures is tested
    in test_compresskv_compile.py; here, where it writes. For the same reason `tables`' CQL fits take 200 steps.)"""
    monkeypatch.setenv("KVCOMPILE_CACHE", str(tmp_path / "cache"))
    model = str(tiny_folder(tmp_path / "x" / "smollm2-135m-instruct"))
    fixed = read_artifact(tiny_artifact(tmp_path / "h.safetensors"))
    monkeypatch.setattr(HeadsRecipe, "run", lambda self, job, settings, inputs: fixed)
    monkeypatch.setattr(HeadsRecipe, "plot", lambda self, artifact, path: "(no picture of a fixed score)")
    monkeypatch.setattr(HeadsRecipe, "describe", lambda self, artifact: None)
    before = shipped_bytes()
    for command, args in COMPILE_COMMANDS.items():
        result = runner.invoke(app, [command, "--model", model, *args])
        assert result.exit_code == 0, f"{command}: {result.output[-2000:]}"
    assert shipped_bytes() == before
    store = store_folder(model)
    assert store.parent == tmp_path / "cache" / "artifacts" and store != store_folder("default")
    written = sorted(p.name for p in store.glob("*.safetensors"))
    assert written == sorted(["srh_heads.safetensors", "layer_budgets.safetensors", "kvcompose_stats.safetensors",
                              "distilled_scorer.safetensors", "compilerkv_tables.safetensors",
                              "compilerkv_tables.experience.safetensors", "tuned_defaults.safetensors"])  # fmt: skip
    assert default_artifact(model, "kvcompose_stats") == store / "kvcompose_stats.safetensors"


@pytest.mark.parametrize("spelled", ["artifacts/smollm2-135m-instruct/kvcompose_stats.safetensors", "artifacts/x.safetensors",
                                     "calibration_data/../artifacts/gemma-3-270m/y.safetensors"])  # fmt: skip
def test_an_out_inside_the_shipped_artifacts_is_refused_before_any_work(spelled, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("KVCOMPILE_CACHE", str(tmp_path / "cache"))
    before = shipped_bytes()
    result = runner.invoke(app, ["stats", "--out", spelled])
    assert result.exit_code == 2 and "is inside the shipped artifacts" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and shipped_bytes() == before
    link = tmp_path / "link"
    link.symlink_to(ROOT / "artifacts")
    result = runner.invoke(app, ["eval", "--out", str(link / "runs")])  # through a link, any command's output
    assert result.exit_code == 2 and "is inside the shipped artifacts" in result.output, result.output


def test_the_store_is_read_before_the_shipped_artifacts_and_written_instead_of_them(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_CACHE", str(tmp_path / "cache"))
    shipped = artifact_folder("default") / "kvcompose_stats.safetensors"
    assert default_artifact("default", "kvcompose_stats") == shipped  # nothing compiled here yet
    compiled = compiled_artifact("default", "kvcompose_stats")  # the store's folder of the shipped weights
    weights = folder_identity(artifact_folder("default")).weights_hash
    assert compiled == tmp_path / "cache" / "artifacts" / f"LlamaForCausalLM-{weights}" / "kvcompose_stats.safetensors"
    compiled.parent.mkdir(parents=True)
    shutil.copy(shipped, compiled)
    assert default_artifact("default", "kvcompose_stats") == compiled  # what the user compiled wins
    assert default_artifact("default", "srh_heads") == artifact_folder("default") / "srh_heads.safetensors"


# --- the dequantised cache: keyed by content, checked on use ------------------------------------------------------


def test_the_cache_folder_follows_the_weights_bytes_not_the_files_name(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_CACHE", str(tmp_path / "cache"))
    versions = dm.converter_versions()
    first = tmp_path / "a" / "model.gguf"
    first.parent.mkdir()
    first.write_bytes(gguf_bytes())
    folder = model_cache.cache_folder(first, versions)
    same = tmp_path / "b" / "renamed.bin"  # the same weights, given by another path and name
    same.parent.mkdir()
    same.write_bytes(first.read_bytes())
    assert model_cache.cache_folder(same, versions) == folder
    # The probe's case: a same-named file of the same size with other tensors, written within the same second.
    first.write_bytes(gguf_bytes(data=bytes(range(32))))
    assert first.stat().st_size == same.stat().st_size and model_cache.cache_folder(first, versions) != folder
    assert model_cache.cache_folder(same, versions) == folder
    assert not (tmp_path / "cache" / "hashes").exists()  # files that just changed are hashed at each use
    # A settled file's hash is recorded against its identity, and a rewrite (new times) is read anew.
    monkeypatch.setattr(model_cache, "SETTLED_SECONDS", -1.0)
    settled = model_cache.cache_folder(first, versions)
    assert (
        len(list((tmp_path / "cache" / "hashes").iterdir())) == 1
        and model_cache.cache_folder(first, versions) == settled
    )
    first.write_bytes(gguf_bytes(data=bytes(range(1, 33))))
    assert model_cache.cache_folder(first, versions) not in (settled, folder)


def test_a_gguf_named_bin_is_loaded_as_a_gguf(tmp_path, monkeypatch):
    gguf = tmp_path / "model.bin"
    gguf.write_bytes(gguf_bytes())
    calls = []
    monkeypatch.setattr(model_loading, "load_gguf_model", lambda *args: calls.append(args[:2]) or (1, 2))
    assert kvruntime.load_model(str(gguf)) == (1, 2) and calls == [(gguf.resolve(), "model")]


def test_a_corrupt_or_truncated_joined_gguf_is_joined_again(tmp_path, monkeypatch):
    chunk_package(tmp_path, monkeypatch, hashlib.sha256(GGUF_BYTES).hexdigest())
    joined = dm.gguf_of("fake")
    for damage in (bytes(len(GGUF_BYTES)), GGUF_BYTES[:-7]):  # corrupted in place, then truncated
        joined.write_bytes(damage)
        assert dm.gguf_of("fake") == joined and joined.read_bytes() == GGUF_BYTES


def counted_builds(monkeypatch: pytest.MonkeyPatch, damage: object = None) -> list[int]:
    """Stand in for dequantise_gguf with a tiny model (each build counted), damaged by `damage(folder)` after it is
    written where given."""
    builds: list[int] = []

    def build(_gguf: Path, staging: Path) -> dict:
        builds.append(1)
        written = write_tiny_model(staging, tiny_spec())
        if damage is not None:
            damage(staging)
        return written

    monkeypatch.setattr(dm, "dequantise_gguf", build)
    return builds


def load_tiny(folder: Path) -> tuple:
    return model_loading._load_folder(folder, __import__("torch").float32)


def truncate_weights(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def test_a_truncated_cache_entry_is_rebuilt_once_then_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(gguf_bytes())
    builds = counted_builds(monkeypatch)
    dm.load_gguf_model(gguf, "Tiny", load_tiny)
    truncate_weights(model_cache.cache_folder(gguf, dm.converter_versions()))
    model, _ = dm.load_gguf_model(gguf, "Tiny", load_tiny)  # rebuilt: a whole model again
    assert len(builds) == 2 and model.config.num_hidden_layers == tiny_model("llama").config.num_hidden_layers
    truncate_weights(model_cache.cache_folder(gguf, dm.converter_versions()))
    builds = counted_builds(monkeypatch, damage=truncate_weights)  # every rebuild comes out broken
    with pytest.raises(KVRuntimeError, match="the cached model of Tiny fails its check .* even after a rebuild"):
        dm.load_gguf_model(gguf, "Tiny", load_tiny)
    assert len(builds) == 1


def test_a_model_with_missing_weights_is_refused_never_initialised_at_random(tmp_path):
    folder = tiny_folder(tmp_path / "model")
    weights = load_file(folder / "model.safetensors")
    dropped = sorted(weights)[0]
    save_file({name: tensor for name, tensor in weights.items() if name != dropped}, folder / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(KVRuntimeError, match=f"lacks 1 of its weights \\({dropped}"):
        kvruntime.load_model(str(folder))
    (folder / "model.safetensors").unlink()
    with pytest.raises(KVRuntimeError, match="has no weights"):
        kvruntime.load_model(str(folder))


def test_a_killed_builds_staging_folder_is_removed_by_the_next_build(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(gguf_bytes())
    folder = model_cache.cache_folder(gguf, dm.converter_versions())
    leftover = folder.parent / f".{folder.name}.partial-abc123"  # what replace_folder's staging is called
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(bytes(1024))
    counted_builds(monkeypatch)
    dm.load_gguf_model(gguf, "Tiny", load_tiny)
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]


def test_an_empty_cache_variable_is_the_default_cache_not_the_current_folder(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVCOMPILE_CACHE", "")
    assert cache_root() == Path.home() / ".cache" / "kvcompile"
    monkeypatch.setenv("KVCOMPILE_CACHE", "relative")
    assert cache_root() == tmp_path / "relative"
