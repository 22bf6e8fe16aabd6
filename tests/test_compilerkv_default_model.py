"""Integration tests of the shipped CompilerKV tables on the real default model."""

import pathlib

import pytest
import torch
from typer.testing import CliRunner

import kvruntime
from kvcompile.cli import app

pytestmark = pytest.mark.integration
ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDER = ROOT / "artifacts" / "smollm2-135m-instruct"
TABLES = FOLDER / "compilerkv_tables.safetensors"
EXPERIENCE = FOLDER / "compilerkv_experience.safetensors"
PROMPT = ROOT / "calibration_data" / "prompts" / "passkey_2k.txt"
runner = CliRunner()


def test_shipped_tables_are_learned_not_flat(default_model):
    model, _ = default_model
    t = kvruntime.load_artifact(TABLES, model=model, kind="compilerkv_tables").tensors
    heads, gate = t["head_reliability"], t["risk_thresholds"]
    assert t["budgets"].tolist() == [128, 256, 512, 1024]
    # W_head differs between the heads of a layer in most (budget, layer) pairs, and spans the grid.
    varies_across_heads = heads.amax(dim=2) > heads.amin(dim=2)
    assert float(varies_across_heads.float().mean()) > 0.5
    assert len(heads.unique()) > 10
    # T_gate changes with entropy and with perplexity within a (budget, layer).
    assert bool((gate.amax(dim=2) > gate.amin(dim=2)).any())
    assert bool((gate.amax(dim=3) > gate.amin(dim=3)).any())
    assert t["head_learning_curve"].shape[1] == 10 and t["round_changes"].shape[0] >= 1


def test_relearning_from_the_shipped_experience_reproduces_the_shipped_tables(tmp_path):
    out = tmp_path / "compilerkv_tables.safetensors"
    result = runner.invoke(app, ["tables", "--from-experience", str(EXPERIENCE), "--out", str(out)])
    assert result.exit_code == 0, result.output
    shipped, relearned = kvruntime.read_artifact(TABLES).tensors, kvruntime.read_artifact(out).tensors
    for name in (
        "head_reliability",
        "risk_thresholds",
        "entropy_edges",
        "perplexity_edges",
        "head_support",
        "gate_support",
    ):
        assert torch.equal(shipped[name], relearned[name]), name


def test_generate_with_compilerkv_at_a_compiled_budget_and_refuse_another():
    result = runner.invoke(
        app,
        [
            "generate",
            "--method",
            "compilerkv",
            "--budget",
            "256",
            "--prompt-file",
            str(PROMPT),
            "--max-new-tokens",
            "8",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "tables of compiled budget 256" in result.output
    refused = runner.invoke(
        app,
        [
            "generate",
            "--method",
            "compilerkv",
            "--budget",
            "300",
            "--prompt-file",
            str(PROMPT),
            "--max-new-tokens",
            "2",
        ],
    )
    assert refused.exit_code == 2 and "not 300" in refused.output
    nearest = runner.invoke(
        app,
        [
            "generate",
            "--method",
            "compilerkv",
            "--budget",
            "300",
            "--nearest-budget",
            "--prompt-file",
            str(PROMPT),
            "--max-new-tokens",
            "2",
        ],
    )
    assert nearest.exit_code == 0 and "tables of compiled budget 256" in nearest.output
