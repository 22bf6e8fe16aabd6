"""A compressed context saved to a file and answered from in another process, without the document (issue #76):
token for token as the context in memory, on a plain and a hybrid model, questions one by one and in a batch; and
every hostile file refused in one line before any of it is used."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import gemma_marks, save_char_tokenizer, tiny_model
from safetensors.torch import save as safetensors_save
from transformers import AutoTokenizer
from typer.testing import CliRunner

import kvruntime
from kvcompile.cli import app
from kvcompile.recipe import artifact_folder
from kvruntime.artifacts.artifact import tensors_checksum
from kvruntime.errors import ArtifactError, KVRuntimeError
from kvruntime.plumbing.batch_rows import left_pad

runner = CliRunner()
GREEDY = dict(do_sample=False, max_new_tokens=6, pad_token_id=0)
DOCUMENT = "The pass key is 4417. Remember it, the rest is filler: the sky is blue and the grass is green. " * 3
QUESTIONS = ["What is the pass key?", "What colour is grass?"]  # as many tokens: a batch without padding


@pytest.fixture
def tokenizer(tmp_path: Path):
    save_char_tokenizer(tmp_path / "tok")
    return AutoTokenizer.from_pretrained(tmp_path / "tok")


def encoded(tokenizer, text: str) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


def forward_lengths(model: torch.nn.Module) -> list[int]:
    """The token count of every forward the model runs from now on (a prefill of the document would show)."""
    lengths: list[int] = []
    model.model.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    return lengths


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])  # gemma3_text: sliding layers (window 16) beside full ones
@pytest.mark.parametrize("memory", ["padded", "masked"])
def test_a_saved_context_answers_as_the_context_in_memory_without_the_document(kind, memory, tokenizer, tmp_path):
    model = tiny_model(kind)
    document = encoded(tokenizer, DOCUMENT)
    questions = [encoded(tokenizer, "\n" + text)[0] for text in QUESTIONS]
    batch, mask = left_pad(questions, 0)
    with kvruntime.compress(model, "kvcompress", ratio=0.6, memory=memory) as session:
        context = session.prefill(document)
        expected = [context.generate(question[None], **GREEDY) for question in questions]
        if kind == "llama":  # a batch: each row compressed as alone
            expected_batch = session.prefill(document.repeat(2, 1)).generate(batch, attention_mask=mask, **GREEDY)
        else:  # in memory a batch on sliding layers is refused; a file's rows hold one context, each its own answer
            expected_batch = torch.cat(expected)
        saved = kvruntime.save_context(context, tmp_path / "doc.safetensors", tokenizer, "raw", "\n")
        assert memory == "padded" or context.keep_masks, "the masked case needs heads that keep different counts"
        held = context.report.bytes_after
    other = tiny_model(kind)  # the same weights in another model object: nothing carried over
    lengths = forward_lengths(other)
    with kvruntime.load_context(other, saved, tokenizer) as loaded:
        got = [loaded.generate(question[None], **GREEDY) for question in questions]
        got_batch = loaded.generate(batch, attention_mask=mask, **GREEDY)
        assert loaded.bytes_held == held and loaded.context_length == document.shape[1] and bool(mask.all())
        if kind == "gemma3_text":  # padding would shift a sliding layer's band: refused, as in memory
            with pytest.raises(KVRuntimeError, match="sliding-window layers"):
                loaded.generate(*left_pad([questions[0], questions[1][1:]], 0), **GREEDY)
    for one, two in zip(got, expected, strict=True):
        assert torch.equal(one, two)
    assert torch.equal(got_batch, expected_batch) and not torch.equal(got[0], got[1])
    assert max(lengths) == max(len(question) for question in questions)  # questions and answers, never the document
    assert saved.stat().st_size - held < 0.2 * held  # positions (int32) and a header beside the bytes held


def test_a_sliding_layer_keeps_its_window_and_the_count_of_tokens_it_has_seen(tokenizer, tmp_path):
    model = tiny_model("gemma3_text")
    document = encoded(tokenizer, DOCUMENT)
    with kvruntime.compress(model, "snapkv", ratio=0.5) as session:
        context = session.prefill(document)
        saved = kvruntime.save_context(context, tmp_path / "doc.safetensors", tokenizer)
    with kvruntime.load_context(model, saved, tokenizer) as loaded:
        rebuilt = loaded.context(1).cache
    length = document.shape[1]
    for index in (0, 2):  # the sliding layers: the window's last entries, at the positions before the end
        assert rebuilt.layers[index].keys.shape[2] == 15 and rebuilt.layers[index].cumulative_length == length
        assert torch.equal(
            loaded.tensors[f"positions.{index}"][0, 0], torch.arange(length - 15, length, dtype=torch.int32)
        )
        assert torch.equal(rebuilt.layers[index].keys, context.cache.layers[index].keys)
    kept = session.kept_positions[0][0, 0].to(torch.int32)  # the first full layer's first head
    assert torch.equal(loaded.tensors["positions.1"][0, 0], kept) and len(kept) < length


def saved_context(tokenizer, tmp_path: Path, kind: str = "llama") -> Path:
    model = tiny_model(kind)
    with kvruntime.compress(model, "snapkv", ratio=0.5) as session:
        context = session.prefill(encoded(tokenizer, DOCUMENT))
        return kvruntime.save_context(context, tmp_path / "doc.safetensors", tokenizer, "raw", "\n")


def rewritten(path: Path, change, out: Path, keep_checksum: bool = False) -> Path:
    """The file with `change` applied to its tensors (a dict), its metadata kept, the checksum recomputed (a crafted
    file, not a corrupted one) unless `keep_checksum`."""
    from safetensors import safe_open

    with safe_open(path, "pt") as handle:
        metadata = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    change(tensors)
    if not keep_checksum:
        metadata["checksum"] = tensors_checksum(tensors)
    out.write_bytes(safetensors_save(tensors, metadata))
    return out


def header_rewritten(path: Path, change, out: Path) -> Path:
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    change(header)
    text = json.dumps(header).encode()
    out.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + size :])
    return out


def hostile_files(tokenizer, tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Each hostile file and the words its refusal says."""
    good = saved_context(tokenizer, tmp_path)

    def nan(tensors):
        tensors["values.2"][0, 1, 3, 5] = float("nan")

    def disordered(tensors):
        tensors["positions.1"] = tensors["positions.1"].flip(-1).contiguous()

    def beyond(tensors):
        tensors["positions.3"][0, 0, -1] = 10_000

    def narrower(tensors):
        tensors["keys.0"] = tensors["keys.0"][..., :8].contiguous()

    def past_the_file(header):
        header["values.3"]["data_offsets"][1] += 4096

    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-100])
    (tmp_path / "other").mkdir()
    return {
        "other model": (saved_context(tokenizer, tmp_path / "other", "qwen2"), "was made for Qwen2ForCausalLM"),
        "truncated": (truncated, "the file holds"),
        "declared size": (header_rewritten(good, past_the_file, tmp_path / "past.safetensors"), "declares"),
        "shape": (rewritten(good, narrower, tmp_path / "narrow.safetensors"), "tensor keys.0 is F32 [1, 2, "),
        "nan": (rewritten(good, nan, tmp_path / "nan.safetensors"), "holds NaN or infinite"),
        "order": (rewritten(good, disordered, tmp_path / "order.safetensors"), "positions are not increasing"),
        "range": (rewritten(good, beyond, tmp_path / "range.safetensors"), "positions are not increasing"),
        "corrupted": (rewritten(good, nan, tmp_path / "corrupt.safetensors", keep_checksum=True), "checksum"),
    }


def test_every_hostile_context_file_is_refused_in_one_line_before_any_of_it_is_used(tokenizer, tmp_path):
    model = tiny_model("llama")
    lengths = forward_lengths(model)
    for name, (path, words) in hostile_files(tokenizer, tmp_path).items():
        with pytest.raises(ArtifactError, match=re.escape(words)) as refused:
            with kvruntime.load_context(model, path, tokenizer):
                pytest.fail(f"{name}: loaded")
        assert "\n" not in str(refused.value), name
    other = AutoTokenizer.from_pretrained(tmp_path / "tok")
    other.add_tokens(["<extra>"])  # one more word: another tokenizer
    with pytest.raises(ArtifactError, match="with another tokenizer than this model's"):
        with kvruntime.load_context(model, saved_context(tokenizer, tmp_path), other):
            pass
    assert lengths == []


def model_folder(tmp_path: Path, kind: str = "llama") -> str:
    folder = tmp_path / f"model-{kind}"
    tiny_model(kind).save_pretrained(folder)
    save_char_tokenizer(folder)
    return str(folder)


def test_generate_saves_a_context_and_a_new_process_answers_from_it_as_question_mode(tmp_path):
    model = model_folder(tmp_path)
    document = tmp_path / "doc.txt"
    document.write_text(DOCUMENT)
    asked = [arg for text in QUESTIONS for arg in ("--question", text)]
    common = ["generate", "--model", model, "--max-new-tokens", "6", *asked]
    in_memory = runner.invoke(app, [*common, "--prompt-file", str(document), "--method", "snapkv"])
    saved = runner.invoke(
        app, [*common[:5], "--prompt-file", str(document), "--method", "snapkv", "--save-context", str(tmp_path / "c")]
    )
    assert in_memory.exit_code == 0 and saved.exit_code == 0, in_memory.output + saved.output
    assert f"saved the compressed context to {tmp_path / 'c'}" in saved.output and "Q:" not in saved.output
    answered = subprocess.run(
        [sys.executable, "-m", "kvcompile.cli", *common, "--context", str(tmp_path / "c")],
        capture_output=True, text=True, env={**os.environ, "KVCOMPILE_CACHE": str(tmp_path / "cache")},
    )  # fmt: skip
    assert answered.returncode == 0, answered.stderr
    answers = [line for line in in_memory.output.splitlines() if line.startswith(("Q:", "A:"))]
    assert [line for line in answered.stdout.splitlines() if line.startswith(("Q:", "A:"))] == answers
    assert "the document not prefilled" in answered.stdout and "snapkv, ratio 0.5" in answered.stdout


def test_generate_refuses_each_hostile_context_file_in_one_line(tokenizer, tmp_path, monkeypatch):
    from kvruntime.models import model_loading

    model = model_folder(tmp_path)
    files = hostile_files(tokenizer, tmp_path)
    before_loading = {"other model", "truncated", "declared size", "shape"}
    load_folder, refusing = model_loading._load_folder, []

    def guarded(*args: object, **kwargs: object) -> object:
        if refusing:
            pytest.fail(f"{refusing[0]}: the model was loaded")
        return load_folder(*args, **kwargs)

    monkeypatch.setattr(model_loading, "_load_folder", guarded)
    for name, (path, words) in files.items():
        refusing[:] = [name] if name in before_loading else []
        result = runner.invoke(app, ["generate", "--model", model, "--context", str(path), "--question", "Key?"])
        assert result.exit_code == 2 and words in result.output and "Q:" not in result.output, (name, result.output)
        refusal = [line for line in result.output.splitlines() if words in line]
        assert len(refusal) == 1 and refusal[0].startswith("error: "), (name, result.output)
    args = ["generate", "--model", model, "--context", str(files["nan"][0])]
    assert "give at least one --question" in runner.invoke(app, args).output
    refused = runner.invoke(app, [*args, "--question", "Key?", "--ratio", "0.5", "--method", "snapkv"])
    assert refused.exit_code == 2 and "leave out --method, --ratio" in refused.output


def test_save_context_saves_one_document(tmp_path):
    model = model_folder(tmp_path)
    document = tmp_path / "doc.txt"
    document.write_text(DOCUMENT)
    args = ["generate", "--model", model, "--prompt-file", str(document)]
    refused = runner.invoke(app, [*args, "--prompt-file", str(document), "--save-context", str(tmp_path / "c")])
    assert refused.exit_code == 2 and "give one prompt file, not 2 prompts" in refused.output
    refused = runner.invoke(app, [*args, "--save-context", str(tmp_path)])
    assert refused.exit_code == 2 and "give a file in a folder that exists" in refused.output
    default = runner.invoke(app, [*args, "--save-context", str(tmp_path / "c")])  # the most faithful measured
    assert default.exit_code == 2 and "method 'distilled' needs distilled_scorer" in default.output


@pytest.mark.integration
@pytest.mark.parametrize("name", ["default", pytest.param("gemma-3-270m", marks=gemma_marks())])
def test_a_shipped_models_saved_context_answers_in_a_new_process_as_in_memory(name, tmp_path):
    """The plain default model and the hybrid Gemma (sliding layers; its `<bos>`): two questions from a file in
    a new process, as question mode answers them; a batch of two from the file as the context in memory answers
    each."""
    prompt = "calibration_data/prompts/passkey_2k_context.txt"
    questions = ["What is the pass key? Answer with the number.", "What color is the sky in the text?"]
    common = ["generate", "--model", name, "--max-new-tokens", "8", *(a for q in questions for a in ("--question", q))]
    saving = [*common, "--prompt-file", prompt, "--method", "distilled", "--save-context", str(tmp_path / "c")]
    saved = runner.invoke(app, saving)
    assert saved.exit_code == 0, saved.output
    answered = subprocess.run([sys.executable, "-m", "kvcompile.cli", *common, "--context", str(tmp_path / "c")],
                              capture_output=True, text=True)  # fmt: skip
    assert answered.returncode == 0, answered.stderr
    lines = [line for line in saved.output.splitlines() if line.startswith(("Q:", "A:"))]
    assert [line for line in answered.stdout.splitlines() if line.startswith(("Q:", "A:"))] == lines and len(lines) == 4
    model, tokenizer = kvruntime.load_model(name)
    document = tokenizer(Path(prompt).read_text(), return_tensors="pt").input_ids  # `<bos>` where it adds one
    asked = [encoded(tokenizer, "\n" + q)[0] for q in questions]
    asked[0] = asked[0][: len(asked[1])]  # as many tokens: a batch without padding, which sliding layers refuse
    batch = torch.stack(asked)
    scorer = artifact_folder(name) / "distilled_scorer.safetensors"
    greedy = dict(GREEDY, min_new_tokens=GREEDY["max_new_tokens"])  # rows of one length, an end of text or not
    with kvruntime.compress(model, "distilled", ratio=0.5, artifacts=[scorer]) as session:
        context = session.prefill(document)
        expected = torch.cat([context.generate(ids[None], **greedy) for ids in asked])  # one at a time
        kvruntime.save_context(context, tmp_path / "d", tokenizer, "raw", "\n")
    with kvruntime.load_context(model, tmp_path / "d", tokenizer) as loaded:
        assert torch.equal(loaded.generate(batch, **greedy), expected)
