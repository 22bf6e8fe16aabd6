"""The default model's cache: the tokenizer built from GGUF metadata, its check, rebuilding a cache that fails it,
and concurrent first builds. Unit tests on a tiny byte-level BPE and a tiny Llama; the real GGUF in the
integration tests at the end."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import tiny_model
from transformers import AutoTokenizer

from kvruntime.errors import KVRuntimeError
from kvruntime.models import default_model as dm
from kvruntime.models import gguf_tokenizer as gt
from kvruntime.models import model_cache

ROOT = Path(__file__).resolve().parents[1]


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (the byte-level BPE's base vocabulary)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            codes.append(256 + extra)
            extra += 1
    order = printable + [b for b in range(256) if b not in printable]
    return [chr(code) for _, code in sorted(zip(order, codes))]


def tiny_spec(eos_id: int = 2) -> gt.GGUFTokenizer:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ("H e", "He l", "Hel l", "Hell o", "Ġ w", "Ġw o")
    tokens = specials + byte_level_alphabet() + ["He", "Hel", "Hell", "Hello", "Ġw", "Ġwo"]
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return gt.GGUFTokenizer(
        model="gpt2",
        pre="smollm",
        tokens=tuple(tokens),
        token_types=(3, 3, 3) + (1,) * (len(tokens) - 3),
        merges=merges,
        bos_id=1,
        eos_id=eos_id,
        unk_id=0,
        pad_id=2,
        add_bos=False,
        add_space_prefix=False,
        chat_template=template,
    )


def write_tiny_model(folder: Path, spec: gt.GGUFTokenizer) -> dict:
    """A stand-in for dequantise_gguf: a tiny Llama and the tokenizer built from `spec`."""
    model = tiny_model("llama")
    model.resize_token_embeddings(len(spec.tokens))
    model.save_pretrained(folder)
    gt.build_tokenizer(spec).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(gt.tokenizer_config(spec, 512)))
    return {"tokenizer": gt.tokenizer_reference(spec)}


def test_the_tokenizer_built_from_gguf_metadata_round_trips_and_has_the_ggufs_special_tokens(tmp_path):
    spec = tiny_spec()
    write_tiny_model(tmp_path, spec)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tokenizer.tokenize("Hello world") == ["Hello", "Ġwo", "r", "l", "d"]  # the merges, applied by hand
    assert tokenizer("Hello").input_ids == [spec.tokens.index("Hello")]  # no BOS: the GGUF says add_bos false
    assert (tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token) == (
        "<|im_end|>",
        "<|im_start|>",
        "<|im_end|>",
    )
    assert tokenizer.tokenize("2026") == ["2", "0", "2", "6"]
    assert tokenizer.decode(tokenizer(gt.ROUND_TRIP_PROBE).input_ids) == gt.ROUND_TRIP_PROBE
    assert gt.tokenizer_problems(tokenizer, gt.tokenizer_reference(spec)) == []
    # It survives a save and reload by transformers itself (what 5.2's converted tokenizer did not).
    tokenizer.save_pretrained(tmp_path / "again")
    again = AutoTokenizer.from_pretrained(str(tmp_path / "again"))
    assert gt.tokenizer_problems(again, gt.tokenizer_reference(spec)) == []


def test_the_check_names_what_is_wrong(tmp_path):
    spec = tiny_spec()
    reference = gt.tokenizer_reference(spec)
    write_tiny_model(tmp_path, tiny_spec(eos_id=1))  # eos <|im_start|>: what transformers 5.2 converted
    problems = gt.tokenizer_problems(AutoTokenizer.from_pretrained(str(tmp_path)), reference)
    assert any("eos is '<|im_start|>' (id 1), the GGUF says '<|im_end|>' (id 2)" in p for p in problems)
    # A tokenizer that inserts unknown tokens between words (5.2's reload) fails the round trip.
    config = json.loads((tmp_path / "tokenizer.json").read_text())
    config["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    (tmp_path / "tokenizer.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(gt.tokenizer_config(spec, 512)))
    problems = gt.tokenizer_problems(AutoTokenizer.from_pretrained(str(tmp_path)), reference)
    assert any("does not survive encode and decode" in p for p in problems)
    assert (
        reference["chat_template_sha256"]
        != gt.tokenizer_reference(gt.GGUFTokenizer(**{**spec.__dict__, "chat_template": None}))["chat_template_sha256"]
    )


def counting_build(count_dir: Path, seconds: float = 0.0):
    def build(staging: Path) -> dict:
        (count_dir / f"{os.getpid()}-{time.monotonic_ns()}").touch()
        (staging / "config.json").write_text("{}")
        time.sleep(seconds)
        return {"pid": os.getpid()}

    return build


def _ensure_in_child(folder: str, count_dir: str, queue) -> None:
    marker = model_cache.ensure_cache(Path(folder), counting_build(Path(count_dir), seconds=1.0))
    queue.put(marker["build"])


def test_concurrent_first_builds_end_with_one_cache_built_once(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_CACHE", str(tmp_path / "cache"))  # the lock files, for the children too
    folder, counts = tmp_path / "models" / "m", tmp_path / "counts"
    counts.mkdir()
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    children = [context.Process(target=_ensure_in_child, args=(str(folder), str(counts), queue)) for _ in range(4)]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
    builds = {queue.get(timeout=5) for _ in children}
    assert len(list(counts.iterdir())) == 1 and len(builds) == 1  # one build, every process reads it
    assert [p.name for p in folder.parent.iterdir()] == ["m"]  # no staging folder left
    assert model_cache.read_marker(folder)["build"] == builds.pop()


def test_a_stale_build_is_replaced_and_a_failed_build_leaves_the_old_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_CACHE", str(tmp_path / "cache"))
    folder, counts = tmp_path / "models" / "m", tmp_path / "counts"
    counts.mkdir()
    first = model_cache.ensure_cache(folder, counting_build(counts))
    assert model_cache.ensure_cache(folder, counting_build(counts)) == first  # complete: not built again
    second = model_cache.ensure_cache(folder, counting_build(counts), stale_build=first["build"])
    assert second["build"] != first["build"] and model_cache.read_marker(folder) == second

    def failing(staging: Path) -> dict:
        (staging / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        model_cache.ensure_cache(folder, failing, stale_build=second["build"])
    assert model_cache.read_marker(folder) == second
    assert [p.name for p in folder.parent.iterdir()] == ["m"]
    (folder / model_cache.MARKER).unlink()  # incomplete (no marker): rebuilt even without a stale id
    assert model_cache.ensure_cache(folder, counting_build(counts))["build"] not in (first["build"], second["build"])


def test_a_poisoned_cache_is_rebuilt_and_one_that_stays_wrong_stops_with_one_line(tmp_path, monkeypatch):
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    monkeypatch.setenv("KVCOMPILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(dm, "gguf_of", lambda name: gguf)
    specs = [tiny_spec(eos_id=1), tiny_spec()]  # the first build is poisoned, the rebuild is right

    def build(_gguf: Path, staging: Path) -> dict:
        write_tiny_model(staging, specs.pop(0))
        return {"tokenizer": gt.tokenizer_reference(tiny_spec())}  # the GGUF's reference: eos <|im_end|>

    monkeypatch.setattr(dm, "dequantise_gguf", build)
    load = lambda folder: (None, AutoTokenizer.from_pretrained(str(folder)))  # noqa: E731
    _, tokenizer = dm.load_shipped_model("default", load)
    assert tokenizer.eos_token == "<|im_end|>" and not specs
    assert dm.load_shipped_model("default", load)[1].eos_token == "<|im_end|>"  # the good cache is used as it is

    folder = model_cache.cache_folder(gguf, dm.converter_versions())
    (folder / model_cache.MARKER).unlink()
    specs[:] = [tiny_spec(eos_id=1), tiny_spec(eos_id=1)]
    with pytest.raises(
        KVRuntimeError, match=r"SmolLM2-135M-Instruct fails its check under transformers .* after a rebuild: eos"
    ):
        dm.load_shipped_model("default", load)


def test_the_cache_folder_changes_with_the_converter_versions(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    versions = {"transformers": "5.2.0", "tokenizers": "0.22.2", "gguf": "0.19.0"}
    assert model_cache.cache_folder(gguf, versions) == model_cache.cache_folder(gguf, dict(versions))
    assert model_cache.cache_folder(gguf, versions) != model_cache.cache_folder(
        gguf, {**versions, "transformers": "5.23.0"}
    )
    assert model_cache.cache_folder(gguf, versions) != model_cache.cache_folder(
        gguf, {**versions, "tokenizers": "0.23.3"}
    )


# --- the real default model --------------------------------------------------------------------------------------


@pytest.mark.integration
def test_the_default_tokenizer_survives_save_and_reload_with_the_ggufs_tokens(default_model, tmp_path):
    _, tokenizer = default_model
    spec = gt.read_gguf_tokenizer(dm.default_gguf_path())
    tokenizer.save_pretrained(tmp_path)
    for loaded in (tokenizer, AutoTokenizer.from_pretrained(str(tmp_path))):
        assert loaded("Hello world").input_ids == [spec.tokens.index("Hello"), spec.tokens.index("Ġworld")]
        assert (loaded.eos_token, loaded.eos_token_id) == ("<|im_end|>", spec.eos_id)
        assert loaded.decode(loaded(gt.ROUND_TRIP_PROBE).input_ids) == gt.ROUND_TRIP_PROBE
        chat = loaded.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        assert gt.tokenizer_problems(loaded, gt.tokenizer_reference(spec)) == []


@pytest.mark.integration
def test_two_first_runs_at_once_on_an_empty_cache_answer_and_leave_one_good_cache(tmp_path):
    env = {**os.environ, "KVCOMPILE_CACHE": str(tmp_path / "cache")}
    command = [
        sys.executable,
        "-m",
        "kvcompile.cli",
        "generate",
        "--method",
        "kvcompress",
        "--ratio",
        "0.5",
        "--prompt-file",
        str(ROOT / "calibration_data/prompts/passkey_2k.txt"),
        "--max-new-tokens",
        "12",
    ]
    runs = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outputs = [run.communicate(timeout=600) for run in runs]
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, err
        assert "25613" in out.split("compression report:")[0]
        assert "warn" not in err.lower()  # the demo prints no transformers warnings
    models = tmp_path / "cache" / "models"
    folders = list(models.iterdir())
    assert len(folders) == 1 and not folders[0].name.startswith(".")  # one cache, no staging folder left
    marker = model_cache.read_marker(folders[0])
    assert marker["versions"] == dm.converter_versions()

    # Poisoned as a transformers 5.2 venv did (eos <|im_start|>), the real cache fails its check by name (the rebuild
    # that follows a failed check: test_a_poisoned_cache_is_rebuilt_and_one_that_stays_wrong_stops_with_one_line).
    config = json.loads((folders[0] / "tokenizer_config.json").read_text())
    (folders[0] / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|im_start|>"}))
    problems = gt.tokenizer_problems(AutoTokenizer.from_pretrained(str(folders[0])), marker["tokenizer"])
    assert any(problem.startswith("eos is '<|im_start|>'") for problem in problems), problems
