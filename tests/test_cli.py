"""The command line: one clear line and a non-zero exit for bad input, nothing written."""

import pytest
import torch
import typer
from conftest import tiny_model
from typer.testing import CliRunner

from kvcompile.cli import app
from kvruntime.artifacts.artifact import Artifact, save_artifact
from kvruntime.artifacts.fingerprint import model_fingerprint

runner = CliRunner()


def tiny_artifact(path):
    model = tiny_model("llama")
    return save_artifact(
        Artifact(
            kind="srh_heads",
            tensors={"srh_score": torch.rand(4, 4), "probes": torch.tensor([3])},
            model=model_fingerprint(model),
            provenance={"command": "test", "seed": 0},
            params={"grid": [1, 2]},
        ),
        path,
    )


def test_every_command_has_a_one_line_help():
    for command in ("generate", "info", "heads", "layer-errors", "budgets", "tables", "stats", "eval", "tune"):
        result = runner.invoke(app, [command, "--help"])
        assert result.exit_code == 0
    listing = runner.invoke(app, ["--help"]).output
    assert "Generate from prompt files with a compressed KV cache" in listing
    assert "Print an artifact's kind, model, tensors and metadata" in listing
    assert "Score every query head as a Semantic Retrieval Head" in listing
    assert "Measure each layer's compression error" in listing
    assert "Run the long-context suite through each method" in listing
    assert "Pick, per method, the largest compression ratio" in listing
    # `budgets`, layer-errors' name before issue #65, still runs (recorded in older artifacts) but is not listed
    commands = typer.main.get_command(app).commands
    assert commands["budgets"].hidden and not commands["layer-errors"].hidden
    assert [p.opts for p in commands["budgets"].params] == [p.opts for p in commands["layer-errors"].params]
    assert "budgets" not in [line.split()[1] for line in listing.splitlines() if line.startswith("│ ")]


def test_info_prints_kind_model_tensors_and_metadata(tmp_path):
    path = tiny_artifact(tmp_path / "heads.safetensors")
    result = runner.invoke(app, ["info", str(path)])
    assert result.exit_code == 0, result.output
    assert "srh_heads artifact" in result.output
    assert "LlamaForCausalLM, 4 layers, 4 query heads, 2 KV heads, head dim 16" in result.output
    assert "srh_score: float32 [4, 4]" in result.output and "probes: int64 [1]" in result.output
    assert '"grid"' in result.output


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "not a readable safetensors file"),
        (b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all", "not a readable safetensors file"),
    ],
)
def test_info_refuses_invalid_files_in_one_line(tmp_path, content, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    result = runner.invoke(app, ["info", str(path)])
    assert result.exit_code == 2
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt-file", "missing.txt"], "prompt file missing.txt does not exist"),
        (["--prompt-file", "prompt.txt", "--ratio", "1.5"], "ratio 1.5 is outside [0, 1)"),
        (["--prompt-file", "prompt.txt", "--ratio", "-0.1"], "ratio -0.1 is outside [0, 1)"),
        (["--prompt-file", "prompt.txt", "--method", "h2o"], "unknown method 'h2o'"),
        (["--prompt-file", "prompt.txt", "--model", "./no/such/model"], "model './no/such/model' not found"),
        (["--prompt-file", "binary.txt"], "is not UTF-8 text"),
        (["--prompt-file", "prompt.txt", "--option", "mode"], "--option 'mode': write it as key=value"),
    ],
)
def test_generate_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompt.txt").write_text("Hello there, a short prompt.")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00\x81" * 10)
    before = sorted(tmp_path.iterdir())
    result = runner.invoke(app, ["generate", *args])
    assert result.exit_code == 2
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert sorted(tmp_path.iterdir()) == before


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budgets", "32,256"], "--budgets must lie between the 64-token window and the 2048-token context"),
        (["--utility", "local"], "--utility 'local': use one of global, head"),
        (["--candidates", "8"], "--candidates 8: give at least as many candidate prompts as --prompts 16"),
    ],
)
def test_tables_refuses_bad_settings_before_loading_any_model(monkeypatch, args, message):
    from kvcompile import recipe

    monkeypatch.setattr(
        recipe, "load_model", lambda model, **_: pytest.fail("the model was loaded before the settings were checked")
    )
    result = runner.invoke(app, ["tables", *args])
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["eval", "--tasks", "passkey,ruler"], "unknown tasks ['ruler']"),
        (["eval", "--lengths", "2q"], "--lengths: '2q' is not a length"),
        (["eval", "--ratios", "0.5,1.2"], "--ratios [0.5, 1.2]: give compression ratios in (0, 1)"),
        (["eval", "--methods", "h2o"], "unknown method 'h2o'"),
        (["eval", "--methods", "kvpress-h2o"], "unknown kvpress press 'h2o'"),
        (["eval", "--samples", "0"], "--samples and --new-tokens must be at least 1"),
        (["eval", "--prompt-format", "xml"], "--prompt-format 'xml': use one of auto, chat, raw"),
        (
            ["eval", "--methods", "compresskv", "--artifacts", "nowhere"],
            "compresskv: nowhere: no such artifact file, bundle or folder",
        ),
        (["tune", "--tolerance", "1.5"], "--tolerance 1.5: give an accuracy difference in [0, 1)"),
        (["tune", "--methods", "snapkv,kvpress-snapkv"], "kvpress"),
        (
            ["tune", "--methods", "snapkv,full:kv_bits=8"],
            "the quantized full cache can be compared with kvcompile eval",
        ),
        (["tune", "--ratios", "0"], "give compression ratios in (0, 1)"),
    ],
)
def test_eval_and_tune_refuse_bad_input_before_loading_the_model_and_write_nothing(
    tmp_path, monkeypatch, args, message
):
    from kvcompile import recipe

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        recipe, "load_model", lambda model, **_: pytest.fail("the model was loaded before the settings were checked")
    )
    out = tmp_path / ("out" if args[0] == "eval" else "out.safetensors")  # eval writes a folder, tune an artifact
    result = runner.invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_the_eval_and_tune_help_names_every_task_of_the_suite():
    """The help's list of tasks is the suite's (it once named 7 of 17)."""
    import re

    from kvcompile.tasks.grid import SUITE_TASKS

    for command in ("eval", "tune"):
        result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        words = set(re.findall(r"[a-z_]+", result.output[result.output.index("--tasks") :]))
        assert result.exit_code == 0 and set(SUITE_TASKS) <= words, (command, set(SUITE_TASKS) - words)
