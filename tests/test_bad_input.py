"""The bad-input audit (issue #8) through the command line: every bad artifact, setting or model ends the command
with one line naming the problem, exit code 2, and nothing written.

Read-only (`info`), runtime (`generate --artifact ... --method ...`) and compile (`budgets --heads ...`: a compile
command refuses before it writes) commands are run on a tiny model (`_load` is replaced: no real model is needed).
Covered elsewhere, not repeated here: ratio out of range and unknown method for `generate`
(tests/test_cli.py::test_generate_refuses_bad_input_in_one_line_and_writes_nothing), an empty file and a garbled
header for `info` (tests/test_cli.py::test_info_refuses_invalid_files_in_one_line), and the artifact API itself
(tests/test_artifact.py, tests/test_artifact_fuzz.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import CharTokenizer, tiny_model
from safetensors import safe_open
from safetensors.torch import save_file
from test_artifact import _rewrite_metadata
from transformers import BloomConfig, BloomForCausalLM
from typer.testing import CliRunner

import kvcompile.cli as cli
from kvcompile import recipe
from kvruntime.artifacts.artifact import Artifact, save_artifact, tensors_checksum
from kvruntime.artifacts.fingerprint import model_fingerprint

runner = CliRunner()
LLAMA = tiny_model("llama")
PROMPT = "A short prompt of a few dozen characters."


class TensorTokenizer(CharTokenizer):
    """CharTokenizer with the `return_tensors="pt"` calls a transformers tokenizer answers."""

    def __call__(self, text: str, return_tensors: str | None = None, add_special_tokens: bool = False):
        ids = super().__call__(text).input_ids
        return SimpleNamespace(input_ids=torch.tensor([ids]) if return_tensors == "pt" else ids)


def heads_artifact(folder: Path, model: torch.nn.Module = LLAMA, **tensors: torch.Tensor) -> Path:
    """A valid srh_heads artifact for `model` (4 layers, 4 query heads)."""
    artifact = Artifact(
        kind="srh_heads",
        tensors=tensors or {"srh_score": torch.rand(4, 4, generator=torch.Generator().manual_seed(0))},
        model=model_fingerprint(model),
        provenance={"command": "test"},
    )
    return save_artifact(artifact, folder / "heads.safetensors")


def _edited_header(path: Path, **metadata: str) -> Path:
    _rewrite_metadata(path, **metadata)
    return path


def _with_bytes(path: Path, edit: Callable[[bytes], bytes]) -> Path:
    path.write_bytes(edit(path.read_bytes()))
    return path


def _non_finite(folder: Path, value: float) -> Path:
    """A well-formed artifact (right checksum) holding a NaN or infinity: save_artifact refuses to write one, so
    the file is written the way a buggy or foreign writer would."""
    path = heads_artifact(folder)
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    score = torch.rand(4, 4)
    score[1, 2] = value
    save_file(
        {"srh_score": score}, str(path), metadata={**metadata, "checksum": tensors_checksum({"srh_score": score})}
    )
    return path


def _plain_safetensors(folder: Path) -> Path:
    save_file({"srh_score": torch.rand(4, 4)}, str(folder / "plain.safetensors"))
    return folder / "plain.safetensors"


def _text_file(folder: Path) -> Path:
    path = folder / "notes.safetensors"
    path.write_text("These are notes, not an artifact.\n")
    return path


# name -> (how to make the bad file in a folder, the message); the first group is refused by reading the file alone.
FILE_PROBLEMS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "truncated": (
        lambda d: _with_bytes(heads_artifact(d), lambda b: b[: len(b) - 10]),
        "not a readable safetensors file",
    ),
    "corrupted": (
        lambda d: _with_bytes(heads_artifact(d), lambda b: b[:-1] + bytes([b[-1] ^ 0x40])),
        "corrupted artifact (tensor checksum does not match its metadata)",
    ),
    "not safetensors": (_text_file, "not a readable safetensors file"),
    "no kvcompile metadata": (_plain_safetensors, "a safetensors file without kvcompile metadata"),
    "other format version": (
        lambda d: _edited_header(heads_artifact(d), format_version="2"),
        "artifact format version '2', this kvruntime reads version 1; recompile it",
    ),
    "NaN tensor": (lambda d: _non_finite(d, float("nan")), "tensor 'srh_score' holds NaN or infinite values"),
    "infinite tensor": (lambda d: _non_finite(d, float("inf")), "tensor 'srh_score' holds NaN or infinite values"),
}
MODEL_PROBLEMS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "other architecture": (
        lambda d: heads_artifact(d, tiny_model("qwen2")),
        "compiled for another model (architecture: Qwen2ForCausalLM vs LlamaForCausalLM, artifact vs model)",
    ),
    "other checkpoint": (
        lambda d: heads_artifact(d, tiny_model("llama", seed=1)),
        "compiled for another checkpoint of LlamaForCausalLM",
    ),
    "mis-shaped tensor": (
        lambda d: heads_artifact(d, srh_score=torch.rand(3, 4)),
        "srh_heads tensor 'srh_score' has shape [3, 4], expected [layers=4, query_heads=4]",
    ),
}
ALL_PROBLEMS = {**FILE_PROBLEMS, **MODEL_PROBLEMS}


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """The working directory of a command: a prompt and a corpus, and a tiny Llama for any model name."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(recipe, "load_model", lambda model, **_: (LLAMA, TensorTokenizer()))
    monkeypatch.setattr(recipe, "model_identity", lambda model: model_fingerprint(LLAMA))
    (tmp_path / "prompt.txt").write_text(PROMPT)
    (tmp_path / "corpus.txt").write_text("Some calibration text. " * 200)
    return tmp_path


def listing(folder: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(folder)), p.stat().st_size if p.is_file() else -1) for p in folder.rglob("*"))


def assert_refused(folder: Path, args: list[str], message: str) -> None:
    """The command exits with 2 and one line holding `message`, and leaves the folder as it was."""
    before = listing(folder)
    result = runner.invoke(cli.app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert "Traceback" not in result.output
    assert listing(folder) == before


@pytest.mark.parametrize("problem", FILE_PROBLEMS)
def test_info_refuses_a_bad_artifact_file(workdir, problem):
    make, message = FILE_PROBLEMS[problem]
    assert_refused(workdir, ["info", str(make(workdir))], message)


@pytest.mark.parametrize("problem", ALL_PROBLEMS)
def test_generate_refuses_a_bad_artifact_before_generating(workdir, problem):
    make, message = ALL_PROBLEMS[problem]
    args = ["generate", "--prompt-file", "prompt.txt", "--method", "srh", "--artifact", str(make(workdir))]
    assert_refused(workdir, args, message)


@pytest.mark.parametrize("problem", ALL_PROBLEMS)
def test_a_compile_command_refuses_a_bad_input_artifact_before_writing(workdir, problem):
    make, message = ALL_PROBLEMS[problem]
    args = [
        "layer-errors",
        "--heads",
        str(make(workdir)),
        "--corpus",
        "corpus.txt",
        "--prompt-tokens",
        "96",
        "--out",
        "out/layer_budgets.safetensors",
    ]
    assert_refused(workdir, args, message)


@pytest.mark.parametrize(
    "budget, message",
    [
        ("0", "budget 0 must be a positive number of tokens per layer"),
        ("-3", "budget -3 must be a positive number of tokens per layer"),
        ("500", f"budget 500 tokens per layer is larger than the prompt ({len(PROMPT)} tokens)"),
    ],
)
def test_generate_refuses_a_budget_out_of_range(workdir, budget, message):
    assert_refused(
        workdir, ["generate", "--prompt-file", "prompt.txt", "--method", "snapkv", "--budget", budget], message
    )


def test_generate_refuses_a_model_whose_attention_kvruntime_cannot_run_naming_why(workdir, monkeypatch):
    """BLOOM computes its attention itself (ALiBi), not through transformers' attention interface, where kvruntime
    takes its queries."""
    config = BloomConfig(vocab_size=96, hidden_size=32, n_layer=2, n_head=2)
    monkeypatch.setattr(recipe, "load_model", lambda model, **_: (BloomForCausalLM(config).eval(), TensorTokenizer()))
    message = "model type 'bloom' does not run its attention through transformers' attention interface as sdpa"
    assert_refused(workdir, ["generate", "--prompt-file", "prompt.txt", "--method", "kvcompress"], message)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda folder: folder / "missing.txt", "corpus missing.txt does not exist"),
        (lambda folder: _written(folder / "empty.txt", b"  \n"), "corpus empty.txt is empty"),
        (
            lambda folder: _written(folder / "binary.txt", b"text\x00\x01\x02"),
            "corpus file binary.txt is binary, not text",
        ),
        (
            lambda folder: _written(folder / "latin.txt", "caf\xe9 ".encode("latin-1") * 50),
            "corpus file latin.txt is not UTF-8 text",
        ),
        (lambda folder: _written(folder / "short.txt", b"A short book. " * 20), "is too short for 96-token prompts"),
    ],
)
def test_compile_commands_refuse_bad_corpora_in_one_line_and_write_nothing(tmp_path, monkeypatch, make, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(recipe, "load_model", lambda model, **_: (LLAMA, CharTokenizer()))
    corpus = make(tmp_path).name
    before = sorted(tmp_path.iterdir())
    result = runner.invoke(
        cli.app, ["stats", "--corpus", corpus, "--prompts", "2", "--prompt-tokens", "96", "--out", "s.safetensors"]
    )
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1
    assert sorted(tmp_path.iterdir()) == before


def _written(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_a_device_the_system_plainly_lacks_is_known_without_torch(tmp_path):
    from kvcompile.recipe import device_kind_possible

    assert device_kind_possible("mps", "Darwin") and not device_kind_possible("mps", "Linux")
    assert not device_kind_possible("cuda", "Linux", tmp_path)  # no driver: no CUDA device
    for driver in ("dev/nvidiactl", "proc/driver/nvidia", "dev/kfd"):  # NVIDIA's, or ROCm's (torch.cuda too)
        root = tmp_path / driver.replace("/", "_")
        (root / driver).parent.mkdir(parents=True)
        (root / driver).touch()
        assert device_kind_possible("cuda", "Linux", root)
    assert device_kind_possible("cuda", "Windows", tmp_path) and device_kind_possible("cpu", "Linux", tmp_path)
