"""Batches (issue 36) on tiny Llama, Qwen2 and Qwen3 models: a left-padded batch of prompts of different lengths
gives, row by row, what each prompt gives alone at batch size 1 (the same cache entries, the same greedy tokens,
logits within float tolerance), for every method; the padding is never held where attention can see it; the
report counts each row and the batch's padding; bad batches are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import compiled_artifacts, tiny_model
from test_compilerkv_runtime import save_tables
from typer.testing import CliRunner

import kvcompile.cli as cli
import kvruntime
from kvcompile import recipe
from kvcompile.evaluation import runner
from kvcompile.evaluation.contestants import RuntimeMethod
from kvcompile.evaluation.runner import Scoring, answer_batch, until_stop
from kvruntime import Request
from kvruntime.errors import UnsupportedModelError
from kvruntime.plumbing.batch_rows import left_pad, row_starts, stack_rows, stacked_visibility, with_appended
from kvruntime.requests.request import required_artifact_kinds

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (150, 210, 120)  # the rows' own prompt lengths
PAD = 0
GREEDY = dict(do_sample=False, max_new_tokens=5, output_logits=True, return_dict_in_generate=True, pad_token_id=PAD)
# (method, request, options, prefill chunk): every method and path the runtime serves, second passes and streaming
CASES = [
    ("snapkv", dict(ratio=0.5), {}, None),
    ("kvcompress", dict(ratio=0.6), {}, None),
    ("kvcompress", dict(ratio=0.6, memory="masked"), {}, None),
    ("srh", dict(ratio=0.5), {}, None),
    ("compresskv", dict(ratio=0.5), {}, None),
    ("snapkv+error-aware", dict(ratio=0.5), {}, None),
    ("kvcompose", dict(ratio=0.5), {}, None),
    ("kvcompose", dict(ratio=0.5), {"mode": "dynamic"}, None),
    ("kvcompose", dict(ratio=0.5, memory="masked"), {"unstructured": True}, None),
    ("distilled", dict(ratio=0.75), {}, None),
    ("distilled", dict(ratio=0.75), {"scores": "oracle"}, None),
    ("distilled+error-aware", dict(ratio=0.75), {}, None),
    ("compilerkv", dict(budget=70), {}, None),
    ("snapkv", dict(budget=40), {}, 32),
    ("distilled", dict(ratio=0.75), {"allocation": "uniform"}, 48),
    ("distilled", dict(ratio=0.75), {}, 48),  # the default: compiled shares, streamed
    ("kvcompose", dict(ratio=0.5), {}, 48),  # compiled statistics, streamed
]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def setup(request, tmp_path_factory):
    model = tiny_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    paths = compiled_artifacts(model, folder, (0.5, 0.75), 256) + [save_tables(model, folder)]
    prompts = [
        torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(row))
        for row, length in enumerate(LENGTHS)
    ]
    return model, paths, prompts


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts [1, n] as a batch padded on the left for generation (`left_pad`, checked by hand below)."""
    return left_pad([prompt[0] for prompt in prompts], PAD)


def artifacts_for(method: str, paths) -> list:
    kinds = {kind: path for path in paths for kind in [kvruntime.read_artifact(path).kind]}
    return [kinds[kind] for kind in required_artifact_kinds(method)]


def assert_same_answer(alone, batched, row: int) -> int:
    """Greedy tokens equal and every step's logits within float tolerance; the kernels of a masked batch and of a
    plain prompt add in different orders, so where the two runs part, the prompt alone must have had a near tie (the
    steps after it follow other tokens and are not compared). Returns the steps compared."""
    for step, (expected, got) in enumerate(zip(alone.logits, batched.logits)):
        got = got[row : row + 1]
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
        if expected.argmax() != got.argmax():
            top = expected[0].topk(2).values
            assert float(top[0] - top[1]) < 1e-3, (row, step)
            return step + 1
    prompt_length = alone.sequences.shape[1] - len(alone.logits)
    assert torch.equal(batched.sequences[row, -len(alone.logits) :], alone.sequences[0, prompt_length:])
    return len(alone.logits)


def assert_same_answers(alone: list, batched) -> None:
    """`assert_same_answer` for every row; near ties may end a row's comparison early, but not most of them (a
    batch whose rows all parted at their first tokens would have checked nothing)."""
    compared = sum(assert_same_answer(answer, batched, row) for row, answer in enumerate(alone))
    assert compared > sum(len(answer.logits) for answer in alone) // 2, compared


def compress(model, method, request, options, chunk, paths):
    return kvruntime.compress(
        model, method, options=options, prefill_chunk_size=chunk, artifacts=artifacts_for(method, paths), **request
    )


@pytest.mark.parametrize("method, request_, options, chunk", CASES, ids=lambda c: str(c))
def test_a_batch_gives_each_row_what_the_prompt_gives_alone(setup, method, request_, options, chunk):
    model, paths, prompts = setup
    ids, mask = left_padded(prompts)
    alone = []
    for prompt in prompts:
        with compress(model, method, request_, options, chunk, paths) as session:
            context = session.prefill(prompt)
            alone.append((context.cache, dict(context.keep_masks), session.report, model.generate(prompt, **GREEDY)))
    with compress(model, method, request_, options, chunk, paths) as session:
        context = session.prefill(ids, attention_mask=mask)
        batched = model.generate(ids, attention_mask=mask, **GREEDY)
    report = context.report
    assert [row.entries_per_layer for row in report.rows] == [a[2].entries_per_layer for a in alone]
    for row, (cache, keep_masks, _, _) in enumerate(alone):
        for index, (layer, batch_layer) in enumerate(zip(cache.layers, context.cache.layers)):
            held = layer.keys.shape[2]
            # The row's own entries, exactly as alone, then hidden padding up to the layer's longest row.
            assert torch.equal(batch_layer.keys[row, :, :held], layer.keys[0])
            assert torch.equal(batch_layer.values[row, :, :held], layer.values[0])
            visible = context.keep_masks.get(index, torch.ones_like(batch_layer.keys[..., 0], dtype=torch.bool))
            own = keep_masks.get(index, torch.ones_like(layer.keys[..., 0], dtype=torch.bool))
            assert torch.equal(visible[row, :, :held], own[0])
            assert not visible[row, :, held:].any()
    assert_same_answers([a[3] for a in alone], batched)


def test_questions_of_different_lengths_after_a_batch_of_contexts(setup):
    model, paths, prompts = setup
    questions = [torch.tensor([[7, 19, 40, 2]]), torch.tensor([[11, 5]]), torch.tensor([[23, 8, 60]])]
    alone = []
    for prompt, question in zip(prompts, questions):
        with kvruntime.compress(model, "kvcompress", ratio=0.6, memory="masked") as session:
            alone.append(session.prefill(prompt).generate(question, **GREEDY))
    ids, mask = left_padded(prompts)
    question_ids, question_mask = left_padded(questions)
    with kvruntime.compress(model, "kvcompress", ratio=0.6, memory="masked") as session:
        context = session.prefill(ids, attention_mask=mask)
        held = [layer.keys.clone() for layer in context.cache.layers]
        batched = context.generate(question_ids, attention_mask=question_mask, **GREEDY)
        again = context.generate(question_ids, attention_mask=question_mask, **GREEDY)
    assert torch.equal(batched.sequences, again.sequences)  # the context and its masks were restored
    assert all(torch.equal(a, layer.keys) for a, layer in zip(held, context.cache.layers))
    assert_same_answers(alone, batched)


def test_the_batch_report_counts_each_row_and_the_padding(setup):
    model, _, prompts = setup
    ids, mask = left_padded(prompts)
    with kvruntime.compress(model, "snapkv", ratio=0.5) as session:
        model.generate(ids, attention_mask=mask, max_new_tokens=1, pad_token_id=PAD)
    report = session.batch_report
    config = model.config
    per_slot = 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4  # K+V, fp32
    kept = [length - int(0.5 * length) for length in LENGTHS]
    assert [row.context_length for row in report.rows] == list(LENGTHS)
    assert [row.bytes_after for row in report.rows] == [k * per_slot * config.num_hidden_layers for k in kept]
    assert report.bytes_held == len(LENGTHS) * max(kept) * per_slot * config.num_hidden_layers
    assert report.padding_bytes == sum(max(kept) - k for k in kept) * per_slot * config.num_hidden_layers
    assert report.bytes_before == len(LENGTHS) * max(LENGTHS) * per_slot * config.num_hidden_layers
    assert session.reports[-len(LENGTHS) :] == report.rows
    assert "of which" in str(report) and "padding" in str(report)


def test_an_unpadded_batch_of_equal_prompts_repeats_the_single_answer():
    model = tiny_model("llama")
    prompt = torch.randint(3, 96, (1, 90), generator=torch.Generator().manual_seed(4))
    with kvruntime.compress(model, "kvcompress", ratio=0.5):
        alone = model.generate(prompt, **GREEDY)
        batched = model.generate(prompt.expand(4, -1), **GREEDY)
    assert_same_answers([alone] * 4, batched)


@pytest.mark.parametrize(
    "mask, message",
    [
        (torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]), "left-padded batches"),
        (torch.tensor([[0, 1, 0, 1], [1, 1, 1, 1]]), "left-padded batches"),
        (torch.tensor([[0, 0, 0, 1], [1, 1, 1, 1]]), "row 0 of the batch holds 1 token"),
    ],
)
def test_bad_batches_are_refused_in_one_line(mask, message):
    model = tiny_model("llama")
    with kvruntime.compress(model, "snapkv", ratio=0.5):
        with pytest.raises(UnsupportedModelError, match=message):
            model.generate(torch.full((2, 4), 5), attention_mask=mask, max_new_tokens=1, pad_token_id=PAD)


def test_row_starts_stack_rows_and_visibility_by_hand():
    ids, mask = left_pad([torch.tensor([5, 6, 7]), torch.tensor([8])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert row_starts(None, 2, 5) == [0, 0]
    assert row_starts(torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]), 2, 5) == [2, 0]
    rows = [torch.ones(1, 2, 3, 4), 2 * torch.ones(1, 2, 1, 4)]
    stacked = stack_rows(rows)
    assert stacked.shape == (2, 2, 3, 4)
    assert stacked[1, :, 0].eq(2).all() and stacked[1, :, 1:].eq(0).all()
    positions = stack_rows([torch.tensor([[[4, 1, 0]]]), torch.tensor([[[2]]])], fill=-1)
    assert positions.tolist() == [[[4, 1, 0]], [[2, -1, -1]]]
    hidden_in_row = torch.tensor([[[True, False, True]]])
    visible = stacked_visibility([3, 1], [hidden_in_row, None], heads=1, device=torch.device("cpu"))
    assert visible.tolist() == [[[True, False, True]], [[True, False, False]]]
    assert stacked_visibility([2, 2], [None, None], heads=3, device=torch.device("cpu")) is None
    question = torch.tensor([[0, 1], [1, 1]])
    masks = with_appended({0: visible}, [3, 2], heads=1, appended=question)
    assert masks[0].tolist() == [[[True, False, True, False, True]], [[True, False, False, True, True]]]
    assert masks[1].tolist() == [[[True, True, False, True]], [[True, True, True, True]]]


class DecodingTokenizer:
    """One token per character (ids 3-92), with the tensor call and decode that `kvcompile generate` makes."""

    pad_token_id, eos_token_id = 0, None

    def __call__(self, text: str, return_tensors: str | None = None, add_special_tokens: bool = False):
        ids = [3 + ord(c) % 90 for c in text]
        return SimpleNamespace(input_ids=torch.tensor([ids]) if return_tensors == "pt" else ids)

    def decode(self, ids: torch.Tensor, skip_special_tokens: bool = False) -> str:
        return "".join(chr(int(i) + 29) for i in ids)


def test_generate_answers_several_prompt_files_and_a_jsonl_the_same_in_a_batch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = tiny_model("llama")
    monkeypatch.setattr(recipe, "load_model", lambda name, **_: (model, DecodingTokenizer()))
    Path("a.txt").write_text("the first prompt, " * 8)
    Path("b.txt").write_text("a second and longer prompt of the batch; " * 6)
    Path("more.jsonl").write_text(
        json.dumps("a third one, " * 9) + "\n\n" + json.dumps({"prompt": "fourth " * 12}) + "\n"
    )
    args = ["generate", "--prompt-file", "a.txt", "--prompt-file", "b.txt", "--prompt-file", "more.jsonl"]
    args += ["--method", "snapkv", "--ratio", "0.5", "--prompt-format", "raw", "--max-new-tokens", "3"]
    one_by_one = CliRunner().invoke(cli.app, [*args, "--batch-size", "1"])
    batched = CliRunner().invoke(cli.app, [*args, "--batch-size", "3"])
    assert one_by_one.exit_code == 0 and batched.exit_code == 0, (one_by_one.output, batched.output)

    def answers(output: str) -> dict[str, str]:
        lines = output.splitlines()
        return {line[3:]: lines[i + 1] for i, line in enumerate(lines) if line.startswith("== ")}

    names = ["prompt file a.txt", "prompt file b.txt", "prompt more.jsonl:1", "prompt more.jsonl:3"]
    assert list(answers(batched.output)) == names
    assert answers(batched.output) == answers(one_by_one.output)

    def reports(output: str, kind: str) -> int:
        return sum(line.startswith(kind) for line in output.splitlines())

    # A batch of 3, then the fourth alone.
    assert (
        reports(batched.output, "batch compression report") == 1 and reports(batched.output, "compression report") == 1
    )
    assert reports(one_by_one.output, "compression report") == 4
    with_questions = CliRunner().invoke(
        cli.app, [*args, "--batch-size", "4", "--question", "which?", "--question", "and?"]
    )
    assert with_questions.exit_code == 0, with_questions.output
    assert with_questions.output.count("Q: which?") == 4 and with_questions.output.count("Q: and?") == 4


@pytest.mark.integration
@pytest.mark.parametrize(
    "method",
    ["snapkv", "kvcompress", "srh", "compresskv", "kvcompose", "distilled", "distilled+error-aware", "compilerkv"],
)
def test_the_default_model_answers_a_batch_row_by_row_as_each_prompt_alone(default_model, method):
    model, tokenizer = default_model
    folder = ROOT / "artifacts" / "smollm2-135m-instruct"
    artifacts = [folder / f"{kind}.safetensors" for kind in required_artifact_kinds(method)]
    text = (ROOT / "calibration_data" / "prompts" / "passkey_2k.txt").read_text()
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    prompts = [ids[:, :600], ids[:, 400:800], ids[:, 150:650]]
    with kvruntime.compress(model, method, ratio=0.75, artifacts=artifacts) as session:
        alone = [model.generate(prompt, **GREEDY) for prompt in prompts]
        batch, mask = left_padded(prompts)
        batched = model.generate(batch, attention_mask=mask, **GREEDY)
    report = session.batch_report
    assert [row.context_length for row in report.rows] == [600, 400, 500]
    assert all(abs(row.entries_removed_fraction - 0.75) < 0.01 for row in report.rows), method
    assert_same_answers(alone, batched)


def test_eval_answers_a_batch_as_it_answers_each_prompt_alone(setup):
    """`kvcompile eval --batch-size`: a kvcompile method's batch of prompts gives each prompt the answer, first logits,
    teacher-forced logits and bytes held it gets alone (a stop token ends a row's answer as it ends a lone one)."""
    model, paths, prompts = setup
    contexts = [prompt[:, :-6] for prompt in prompts]
    questions = [prompt[:, -n:] for prompt, n in zip(prompts, (3, 4, 5))]
    contestant = RuntimeMethod("kvcompress", "kvcompress").resolved([], [Request(ratio=0.5)])
    tokenizer = SimpleNamespace(eos_token_id=0, decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    # Answers of other lengths per row (the full cache's, and the expected one): the forced rows are left-padded.
    scorings = [Scoring([7, 3, 9, 4][: 2 + row], [11, 12, 13][row:]) for row in range(3)]
    alone = [
        runner.answer(model, tokenizer, contestant, 0.5, c, q, 6, [], scoring)
        for c, q, scoring in zip(contexts, questions, scorings)
    ]
    batched = answer_batch(model, tokenizer, contestant, 0.5, contexts, questions, 6, scorings)
    for one, row in zip(alone, batched):
        assert row.cache_bytes == one.cache_bytes and row.peak_mib is None
        torch.testing.assert_close(row.first_logits, one.first_logits, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(row.reference_logits, one.reference_logits, atol=2e-4, rtol=1e-4)
        assert row.gold_logprob == pytest.approx(one.gold_logprob, abs=1e-3)
        assert row.tokens == one.tokens and row.text == one.text
    assert until_stop([5, 7, 2, 9, 2], {2}) == [5, 7, 2] and until_stop([5, 7], {2}) == [5, 7]
