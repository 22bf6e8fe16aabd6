"""Compressed and quantized (`kv_bits`): the kept entries move into transformers' quantized cache layers, the bytes
held are counted by hand from the slots kept, answers continue from the quantized context and leave it as it was,
and what cannot be done is refused in one line. The shipped pass key through the command line:
`test_the_shipped_pass_key_is_answered_from_a_compressed_int4_cache` (an integration test)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache
from typer.testing import CliRunner

import kvruntime
from kvruntime.errors import KVRuntimeError
from kvruntime.plumbing.quantized_cache import check_kv_bits, held_bytes, layer_bytes, quantize_cache


def by_hand(slots: list[int], heads: int, head_dim: int, bits: int) -> int:
    """Bytes of keys and values of `slots` entries per layer: FP8 one byte a value and one float32 scale per
    tensor; int4 two rows of `head_dim` values packed in one row of bytes (an odd row count rounds up), and a
    float32 scale and shift per row (one head's vector of one token)."""
    total = 0
    for kept in slots:
        rows = kept * heads
        per_tensor = rows * head_dim + 4 if bits == 8 else -(-rows // 2) * head_dim + 2 * 4 * rows
        total += 2 * per_tensor
    return total


@pytest.mark.parametrize("bits", [8, 4])
def test_the_kept_entries_are_quantized_and_their_bytes_counted_by_hand(bits):
    model = tiny_model("llama")
    ids = torch.randint(1, 90, (1, 96))
    with kvruntime.compress(model, "snapkv", ratio=0.5, kv_bits=bits) as session:
        context = session.prefill(ids)
    report, cache = context.report, context.cache
    config = model.config
    head_dim, heads = config.hidden_size // config.num_attention_heads, config.num_key_value_heads
    assert report.bytes_after == by_hand(report.slots_per_layer, heads, head_dim, bits)
    assert report.bytes_before == 2 * 96 * heads * head_dim * 4 * config.num_hidden_layers  # float32, uncut
    assert all(type(layer).__name__ != "DynamicLayer" for layer in cache.layers)
    assert [layer.get_seq_length() for layer in cache.layers] == report.slots_per_layer
    assert report.notes[-1].startswith("kept entries quantized to")


# int4 keeps its last 128 entries in full precision (quanto's residual), then quantizes them all: a question and
# answer longer than that go through the re-quantization, which must not reach the context's own entries either (a
# long question: each generated token is a forward through quanto, slow on a CPU).
RESIDUAL = 128


@pytest.mark.parametrize("bits, drift", [(8, 0.05), (4, 0.5)])
def test_answers_continue_from_the_quantized_context_and_leave_it_as_it_was(bits, drift):
    model = tiny_model("llama")
    ids, question = torch.randint(1, 90, (1, 96)), torch.randint(1, 90, (1, RESIDUAL - 24))
    greedy = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    with kvruntime.compress(model, "snapkv", ratio=0.5) as session:
        plain = session.prefill(ids)
        plain_logits = plain.logits(question)
    with kvruntime.compress(model, "snapkv", ratio=0.5, kv_bits=bits) as session:
        quantized = session.prefill(ids)
        held = [layer_bytes(layer) for layer in quantized.cache.layers]
        first = quantized.generate(question, **greedy)
        assert [layer_bytes(layer) for layer in quantized.cache.layers] == held  # the answer's tokens are gone
        again = quantized.generate(question, **greedy)
        logits = quantized.logits(question)
        assert [layer_bytes(layer) for layer in quantized.cache.layers] == held
    assert first.shape[1] - question.shape[1] == 32 and torch.equal(first, again)  # 104 + 32 > 128
    # Quantizing moves the logits a little from the unquantized compressed context's, no more (FP8 less than int4).
    assert 0 < (logits - plain_logits).abs().max() < drift * plain_logits.abs().max()


def test_int4_packs_an_odd_number_of_rows_into_whole_bytes():
    """One KV head and an odd budget: 49 rows of 16 values a layer, packed two to a byte row (25 rows), each row
    with its float32 scale and shift."""
    import transformers
    from conftest import TINY

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, "num_key_value_heads": 1})).eval()
    with kvruntime.compress(model, "snapkv", budget=49, kv_bits=4) as session:
        report = session.prefill(torch.randint(1, 90, (1, 96))).report
    assert report.slots_per_layer == [49] * 4
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    assert report.bytes_after == 4 * 2 * (25 * head_dim + 2 * 4 * 49) == by_hand([49] * 4, 1, head_dim, 4)


def test_a_missing_quantizer_is_refused_in_one_line(monkeypatch):
    from transformers import cache_utils

    from kvruntime.plumbing import quantized_cache

    real = quantized_cache.importlib.util.find_spec
    monkeypatch.setattr(
        quantized_cache.importlib.util, "find_spec", lambda name, *a: None if name == "optimum.quanto" else real(name)
    )
    with pytest.raises(KVRuntimeError, match=r"^kv_bits=4 needs optimum-quanto: pip install 'kvruntime\[quant\]'"):
        check_kv_bits(4)
    check_kv_bits(8)  # built in: nothing to install
    monkeypatch.delattr(cache_utils, "Fp8QuantizedLayer")
    with pytest.raises(KVRuntimeError, match="^kv_bits=8 needs transformers' FP8 cache layers"):
        with kvruntime.compress(tiny_model("llama"), "snapkv", ratio=0.5, kv_bits=8) as session:
            session.prefill(torch.randint(1, 90, (1, 96)))


def test_held_bytes_count_whole_storages_and_quantized_parts():
    base = torch.zeros(10, 8)
    assert held_bytes(base[:2]) == 10 * 8 * 4  # a view holds its whole buffer
    assert held_bytes((torch.zeros(3, dtype=torch.uint8), torch.tensor(1.0))) == 3 + 4
    cache = DynamicCache()
    cache.update(torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16), 0)
    quantize_cache(cache, 8)
    assert layer_bytes(cache.layers[0]) == 2 * (6 * 2 * 16 + 4)


@pytest.mark.parametrize("bits", [3, 16, True, "8"])
def test_a_bit_width_not_offered_is_refused_in_one_line(bits):
    with pytest.raises(KVRuntimeError, match=r"kv_bits=.*: give one of 8, 4 \(or none\)"):
        check_kv_bits(bits)


def test_a_batch_is_refused_with_kv_bits():
    model = tiny_model("llama")
    with kvruntime.compress(model, "snapkv", ratio=0.5, kv_bits=8) as session:
        with pytest.raises(KVRuntimeError, match="kv_bits quantizes one prompt at a time"):
            session.prefill(torch.randint(1, 90, (2, 40)))


def test_eval_takes_a_quantized_contestant():
    from kvcompile.evaluation.contestants import parse_methods

    contestant = parse_methods("distilled:kv_bits=4,snapkv")[1]
    assert contestant.method == "distilled" and contestant.kv_bits == 4 and contestant.options == {}
    with pytest.raises(KVRuntimeError, match="kv_bits=5"):
        parse_methods("snapkv:kv_bits=5")


@pytest.mark.integration
def test_the_shipped_pass_key_is_answered_from_a_compressed_int4_cache(default_model, monkeypatch):
    from pathlib import Path

    from kvcompile import cli, recipe

    monkeypatch.setattr(recipe, "load_model", lambda model, **_: default_model)
    prompt = Path(__file__).resolve().parent.parent / "calibration_data" / "prompts" / "passkey_2k.txt"
    args = [
        "generate",
        "--prompt-file",
        str(prompt),
        "--method",
        "distilled",
        "--ratio",
        "0.5",
        "--max-new-tokens",
        "12",
    ]
    result = CliRunner().invoke(cli.app, [*args, "--kv-bits", "4"])
    assert result.exit_code == 0, result.output
    assert "25613" in result.output and "quantized to int4" in result.output
    model, tokenizer = default_model
    ids = tokenizer(prompt.read_text(), return_tensors="pt").input_ids
    artifact = (
        Path(__file__).resolve().parent.parent / "artifacts" / "smollm2-135m-instruct" / "distilled_scorer.safetensors"
    )
    with kvruntime.compress(model, "distilled", ratio=0.5, artifacts=[artifact], kv_bits=4) as session:
        session.prefill(ids)
    report, config = session.report, model.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert report.bytes_after == by_hand(report.slots_per_layer, config.num_key_value_heads, head_dim, 4)
    assert report.bytes_after < 0.17 * report.bytes_before  # half the entries, at 5 of 32 bits a value


def test_eval_measures_quantization_alone_compression_alone_and_both(tmp_path, monkeypatch):
    import json

    from conftest import save_char_tokenizer
    from transformers import AutoTokenizer

    from kvcompile import cli, recipe

    monkeypatch.chdir(tmp_path)
    save_char_tokenizer(tmp_path / "tok")
    model, tokenizer = tiny_model("llama"), AutoTokenizer.from_pretrained(tmp_path / "tok")
    monkeypatch.setattr(recipe, "load_model", lambda name, **_: (model, tokenizer))
    rows = [{"context": "The lamp is red and the door is blue. " * 4, "question": "Which is red?", "answers": ["lamp"]}]
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows * 2))
    methods = "full:kv_bits=8,snapkv,snapkv:kv_bits=8"
    args = ["eval", "--suite", "mine.jsonl", "--methods", methods, "--ratios", "0.5", "--new-tokens", "3"]
    result = CliRunner().invoke(cli.app, [*args, "--out", "run"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (tmp_path / "run" / "runs.jsonl").read_text().splitlines()]
    kept = {(r["method"], r["ratio"]): r["cache_kept"] for r in records if r["prompt"] == 0}
    # float32 entries: FP8 holds a quarter of the bytes (and two scales a layer), half the entries an eighth.
    assert kept.keys() == {("full", 0.0), ("full:kv_bits=8", 0.0), ("snapkv", 0.5), ("snapkv:kv_bits=8", 0.5)}
    assert kept["full:kv_bits=8", 0.0] == pytest.approx(0.25, abs=0.005)
    assert kept["snapkv:kv_bits=8", 0.5] == pytest.approx(kept["snapkv", 0.5] / 4, abs=0.005)
    quantized = [r for r in records if r["method"] == "full:kv_bits=8"]
    assert all(0 < r["answer_kl"] < 0.05 for r in quantized)  # quantized, not cut: close to the full cache
    assert (tmp_path / "run" / "results.md").is_file()
