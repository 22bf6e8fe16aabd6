"""What an outside probe found broken (issue 17): each case refused in one line with exit 2 and nothing written, or,
through the API, the project's own error with the model left usable. Tiny models built in code."""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import TINY, CharTokenizer, tiny_model
from test_bad_input import LLAMA, PROMPT, TensorTokenizer, assert_refused, heads_artifact, listing
from typer.testing import CliRunner

import kvruntime
from kvcompile import cli, recipe
from kvcompile.calibration.job import CompileJob
from kvruntime.artifacts.artifact import Artifact, save_artifact
from kvruntime.artifacts.fingerprint import model_fingerprint
from kvruntime.errors import KVRuntimeError
from kvruntime.files import path_lock

runner = CliRunner()


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVCOMPILE_CACHE", str(tmp_path.parent / f"{tmp_path.name}-cache"))  # locks, outside the folder
    monkeypatch.setattr(recipe, "load_model", lambda model, **_: (LLAMA, TensorTokenizer()))
    (tmp_path / "prompt.txt").write_text(PROMPT)
    (tmp_path / "corpus.txt").write_text("Some calibration text. " * 200)
    return tmp_path


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens 0: give at least 1 token to generate"),
        (["--max-new-tokens", "-1"], "--max-new-tokens -1: give at least 1 token to generate"),
        (["--question", ""], "--question is empty"),
        (["--question", "What is it?", "--question", "  "], "--question is empty"),
        (
            ["--method", "kvcompose", "--option", "unstructured=maybe"],
            "kvcompose option unstructured='maybe' is not a boolean",
        ),
        (
            ["--method", "compilerkv", "--option", "fixed_threshold=high"],
            "compilerkv option fixed_threshold='high' is not a number",
        ),
        (
            ["--method", "kvcompose", "--option", "mode=fast"],
            "unknown kvcompose mode 'fast' (use one of compiled, dynamic)",
        ),
        (["--option", "mode=dynamic"], "--option needs --method"),
    ],
)
def test_generate_refuses_bad_options_in_one_line(workdir, args, message):
    assert_refused(workdir, ["generate", "--prompt-file", "prompt.txt", *args], message)


def test_generate_refuses_a_one_token_prompt_before_generating(workdir):
    (workdir / "one.txt").write_text("A")
    assert_refused(
        workdir,
        ["generate", "--prompt-file", "one.txt", "--method", "snapkv"],
        "holds fewer than 2 tokens: nothing to compress",
    )


def test_folders_given_as_files_are_called_folders(workdir):
    (workdir / "folder.safetensors").mkdir()
    assert_refused(workdir, ["generate", "--prompt-file", "folder.safetensors"], "is a folder: give a text file")
    args = ["generate", "--prompt-file", "prompt.txt", "--method", "srh", "--artifact", "folder.safetensors"]
    assert_refused(workdir, args, "folder.safetensors is a folder without artifacts: give an artifact file")


@pytest.mark.parametrize("broken", ["empty folder", "truncated weights", "no tokenizer"])
def test_a_model_folder_that_cannot_load_is_refused_in_one_line(tmp_path, monkeypatch, broken):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompt.txt").write_text(PROMPT)
    folder = tmp_path / "model"
    folder.mkdir()
    if broken != "empty folder":
        tiny_model("llama").save_pretrained(folder)
        weights = folder / "model.safetensors"
        if broken == "truncated weights":
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    result = runner.invoke(cli.app, ["generate", "--prompt-file", "prompt.txt", "--model", str(folder)])
    assert result.exit_code == 2, result.output
    assert f"cannot load model '{folder}' offline" in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_info_runs_the_runtimes_schema_check(workdir):
    path = heads_artifact(workdir, srh_score=torch.rand(3, 4))
    assert_refused(workdir, ["info", str(path)], "srh_heads tensor 'srh_score' has shape [3, 4], expected [layers=4")
    missing = heads_artifact(workdir, retrieval_score=torch.rand(4, 4))
    assert_refused(workdir, ["info", str(missing)], "srh_heads tensor 'srh_score' is missing")


def test_artifacts_get_the_umasks_modes(tmp_path):
    previous = os.umask(0o022)
    try:
        path = heads_artifact(tmp_path)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


# --- outputs: checked before any work, one writer at a time -----------------------------------------------------


def _partial(folder: Path, index: int) -> Path:
    from kvcompile.calibration.corpus import load_corpus
    from kvcompile.calibration.distributed import parse_shard
    from kvcompile.recipes.kvcompose.attention_stats import compile_attention_stats
    from kvcompile.recipes.kvcompose.settings import StatsSettings

    out = folder / f"s{index}.safetensors"
    settings = StatsSettings(ratios=(0.5,), prompts=2, prompt_tokens=96)
    partial = compile_attention_stats(
        CompileJob(LLAMA, CharTokenizer(), out, shard=parse_shard(f"{index}/2")), load_corpus("corpus.txt"), settings
    )
    return save_artifact(partial, out)


@pytest.fixture
def statsdir(workdir, monkeypatch) -> Path:
    """`workdir` where the compile commands get a tokenizer that gives token lists (as calibration reads them)."""
    monkeypatch.setattr(recipe, "load_model", lambda model, **_: (LLAMA, CharTokenizer()))
    return workdir


STATS = ["stats", "--corpus", "corpus.txt", "--prompts", "2", "--prompt-tokens", "96", "--ratios", "0.5"]


def test_outputs_that_cannot_be_written_are_refused_before_the_model_loads(workdir, monkeypatch):
    def no_model(model, **_):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(recipe, "load_model", no_model)
    (workdir / "file").write_text("x")
    (workdir / "folder").mkdir()
    assert_refused(workdir, ["eval", "--out", "file"], "--out file is a file: give a folder")
    assert_refused(workdir, [*STATS, "--out", "folder"], "--out folder is a folder: give a file name")
    locked = workdir / "readonly"
    locked.mkdir()
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):  # the tests run as root, who may write anywhere: a read-only folder
        if dir is not None and Path(dir) == locked:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return real_mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    assert_refused(workdir, [*STATS, "--out", "readonly/s.safetensors"], "cannot write in")
    assert_refused(workdir, ["eval", "--out", "readonly/results"], "cannot write in")
    assert_refused(workdir, ["tune", "--out", "readonly/t.safetensors"], "cannot write in")


def test_merge_refuses_a_folder_or_one_of_its_inputs_as_out(statsdir):
    workdir = statsdir
    partials = [_partial(workdir, 0), _partial(workdir, 1)]
    (workdir / "folder").mkdir()
    names = [p.name for p in partials]
    assert_refused(workdir, ["merge", *names, "--out", "folder"], "--out folder is a folder")
    assert_refused(
        workdir, ["merge", *names, "--out", names[1]], f"--out {names[1]} is one of the partials being merged"
    )


def test_a_second_run_writing_the_same_out_is_refused(statsdir):
    workdir = statsdir
    with path_lock(workdir / "s.safetensors", wait=False):
        assert_refused(workdir, [*STATS, "--out", "s.safetensors"], "another run is writing")
    result = runner.invoke(cli.app, [*STATS, "--out", "s.safetensors"])  # free again: it runs
    assert result.exit_code == 0, result.output
    assert (workdir / "s.safetensors").exists()


def test_heads_refuses_lengths_it_cannot_probe(workdir, monkeypatch):
    assert_refused(
        workdir,
        ["heads", "--corpus", "corpus.txt", "--lengths", "0"],
        "--lengths 0: a needle probe needs at least 128 tokens",
    )
    too_long = str(TINY["max_position_embeddings"] + 1)
    assert_refused(
        workdir,
        ["heads", "--corpus", "corpus.txt", "--lengths", too_long],
        f"--lengths {too_long}: {too_long} positions, more than the model's {TINY['max_position_embeddings']}",
    )


def test_a_jsonl_text_column_that_holds_numbers_is_called_that(statsdir):
    workdir = statsdir
    (workdir / "numbers.jsonl").write_text("\n".join(json.dumps({"text": i}) for i in range(5)))
    assert_refused(
        workdir,
        [*STATS, "--corpus", "numbers.jsonl", "--out", "s.safetensors"],
        "column 'text' holds int64 values, not text",
    )


def test_starting_over_an_interrupted_run_says_so(statsdir, monkeypatch):
    workdir = statsdir
    from kvcompile.calibration import partial_statistics

    real = partial_statistics.save_checkpoint

    def save_then_stop(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(partial_statistics, "save_checkpoint", save_then_stop)
    result = runner.invoke(cli.app, [*STATS, "--out", "s.safetensors", "--checkpoint-every", "1"])
    assert result.exit_code != 0 and any(p.name.endswith(".partial") for p in workdir.iterdir())
    monkeypatch.setattr(partial_statistics, "save_checkpoint", real)
    result = runner.invoke(cli.app, [*STATS, "--out", "s.safetensors"])
    assert result.exit_code == 0, result.output
    assert "starting over; the checkpoint" in result.output and "--resume continues it" in result.output


# --- the API ---------------------------------------------------------------------------------------------------


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(seed))


def test_nested_blocks_are_refused_and_leave_the_model_usable(tiny):
    ids = _ids(60)
    expected = tiny(ids).logits
    with kvruntime.compress(tiny, "snapkv", ratio=0.5):
        with pytest.raises(KVRuntimeError, match="already inside a `kvruntime.compress"):
            with kvruntime.compress(tiny, "kvcompress", ratio=0.5):
                pass
    assert torch.equal(tiny(ids).logits, expected)
    with kvruntime.compress(tiny, "kvcompress", ratio=0.5) as session:  # a new block works
        session.prefill(ids)


def test_masked_keep_masks_never_reach_another_sequence(tiny):
    """After a masked compression, forwards on new sequences inside the block run as without compression."""
    ids, other = _ids(80), _ids(40, seed=1)
    with torch.no_grad():
        plain = tiny(other, use_cache=False).logits
        one = tiny(other[:, :1]).logits
    with kvruntime.compress(tiny, "kvcompress", ratio=0.5, memory="masked") as session:
        context = session.prefill(ids)
        assert context.keep_masks  # the masked layout is in use
        with torch.no_grad():
            assert torch.allclose(tiny(other, use_cache=False).logits, plain, atol=1e-5)
            assert torch.allclose(tiny(other[:, :1]).logits, one, atol=1e-5)
        tiny.generate(other[:, :1], max_new_tokens=2, do_sample=False, pad_token_id=0)
        with pytest.raises(KVRuntimeError, match="nothing to compress: give at least 2"):
            session.prefill(other[:, :1])


@pytest.mark.parametrize("chunk", [None, 32])
def test_a_prefill_that_fails_part_way_leaves_nothing_for_the_next_and_the_block_puts_the_forward_back(tiny, chunk):
    """A layer that raises in the middle of a prefill (streamed or not): the next prefill in the same block
    compresses as a fresh block does, and after the block the base model holds its own forward again (an
    instance's own forward, as accelerate sets, included)."""
    ids, base = _ids(60), tiny.base_model
    with torch.no_grad():
        plain = tiny(ids, use_cache=False).logits
    with kvruntime.compress(tiny, "snapkv", ratio=0.5, prefill_chunk_size=chunk) as session:
        expected = session.prefill(ids).report.slots_per_layer
    calls = []

    def fail_once(module, args, output):
        calls.append(1)
        if len(calls) == 1:  # the first chunk's (the whole prompt's without chunks): layers 2 and after not yet run
            raise RuntimeError("a layer failed")

    own = base.forward
    base.forward = own  # an instance's own forward (a bound method), as accelerate's hooks set one
    handle = tiny.model.layers[1].self_attn.register_forward_hook(fail_once)
    try:
        with kvruntime.compress(tiny, "snapkv", ratio=0.5, prefill_chunk_size=chunk) as session:
            with pytest.raises(RuntimeError, match="a layer failed"):
                session.prefill(ids)
            handle.remove()
            with torch.no_grad():  # a forward that is no prefill runs as without compression
                assert torch.allclose(tiny(ids, use_cache=False).logits, plain, atol=1e-5)
            assert session.prefill(ids).report.slots_per_layer == expected
    finally:
        handle.remove()
    assert vars(base)["forward"] is own
    del base.forward
    with kvruntime.compress(tiny, "snapkv", ratio=0.5):
        pass
    assert "forward" not in vars(base)


def test_prefill_after_the_block_is_refused(tiny):
    with kvruntime.compress(tiny, "snapkv", ratio=0.5) as session:
        session.prefill(_ids(60))
    with pytest.raises(KVRuntimeError, match="the block has ended"):
        session.prefill(_ids(60, seed=2))


def test_eval_takes_typed_method_options(tmp_path):
    from kvcompile.evaluation.contestants import parse_methods

    contestants = parse_methods("compilerkv:fixed_threshold=0.9,kvcompose:mode=dynamic:unstructured=true")
    assert contestants[1].options == {"fixed_threshold": 0.9}
    assert contestants[2].options == {"mode": "dynamic", "unstructured": True}
    with pytest.raises(KVRuntimeError, match="kvcompose option unstructured='maybe' is not a boolean"):
        parse_methods("kvcompose:unstructured=maybe")


def test_a_reader_sees_the_old_or_the_new_artifact_while_it_is_replaced(tmp_path):
    """Fault injection: a reader of an artifact while another process replaces it gets one whole file or the other."""
    import multiprocessing

    path = heads_artifact(tmp_path)
    first = kvruntime.read_artifact(path).tensors["srh_score"]
    second = torch.rand(4, 4, generator=torch.Generator().manual_seed(9))
    context = multiprocessing.get_context("spawn")
    writer = context.Process(target=_replace_many_times, args=(str(path), first, second))
    writer.start()
    seen = set()
    while writer.is_alive() or not seen:
        score = kvruntime.read_artifact(path).tensors["srh_score"]  # never a half-written file
        assert torch.equal(score, first) or torch.equal(score, second)
        seen.add(torch.equal(score, second))
    writer.join()
    assert writer.exitcode == 0
    # The reads did overlap the writes: they saw the second version, which only ever lives between two writes of
    # the first (the file starts and ends as the first).
    assert seen == {False, True}


def _replace_many_times(path: str, first: torch.Tensor, second: torch.Tensor) -> None:
    model = tiny_model("llama")
    for index in range(40):
        score = second if index % 2 == 0 else first
        save_artifact(Artifact("srh_heads", {"srh_score": score}, model_fingerprint(model), {"command": "test"}), path)


def test_a_full_disk_during_a_write_leaves_the_old_artifact_and_no_temporary_file(tmp_path, monkeypatch):
    """Fault injection: the write fails part way (ENOSPC); the artifact keeps its old content, nothing else remains."""
    import errno

    path = heads_artifact(tmp_path)
    before = listing(tmp_path)

    def disk_full(self: Path, data: bytes) -> int:
        with open(self, "wb") as handle:
            handle.write(data[:7])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", disk_full)
    with pytest.raises(KVRuntimeError, match="cannot write .*heads.safetensors: No space left on device"):
        heads_artifact(tmp_path, srh_score=torch.zeros(4, 4))
    assert listing(tmp_path) == before
    kvruntime.read_artifact(path)  # still whole


def test_kvcompose_and_compilerkv_table_errors_name_the_file(tmp_path):
    fingerprint = model_fingerprint(LLAMA)
    stats = Artifact(
        "kvcompose_stats",
        {
            "ratios": torch.tensor([0.5, 0.3]),
            "layer_fractions": torch.full((2, 4), 0.5),
            "head_fractions": torch.full((2, 4, 2), 0.5),
        },
        fingerprint,
        {"command": "test"},
    )
    path = save_artifact(stats, tmp_path / "stats.safetensors")
    with pytest.raises(
        KVRuntimeError, match=rf"{path}: kvcompose stats: compiled ratios \[0.5, 0.3\] are not increasing"
    ):
        kvruntime.get_method("kvcompose", [kvruntime.load_artifact(path, model=LLAMA)])


def test_every_registered_method_that_needs_no_artifact_is_built_by_its_name():
    from kvruntime.registry import METHODS

    free = [name for name, spec in METHODS.items() if spec.needs is None]
    assert free == ["kvcompress", "snapkv"]
    for name in free:
        assert kvruntime.get_method(name).name == name


def test_every_prompt_of_a_batch_is_checked_before_the_first_is_answered(workdir):
    """Issue #48: a prompt too long for the model among several used to be refused after the earlier ones were
    answered and printed."""
    lines = [json.dumps(PROMPT), json.dumps(PROMPT * 20)]  # the second: 820 characters, past the model's 512
    (workdir / "p.jsonl").write_text("\n".join(lines) + "\n")
    assert_refused(
        workdir,
        ["generate", "--prompt-file", "p.jsonl", "--method", "snapkv", "--max-new-tokens", "2"],
        "prompt p.jsonl:2 (820 tokens) and 2 new tokens: 822 positions, more than the model's 512",
    )


def test_a_window_longer_than_the_prompt_is_refused_as_a_budget_is(tiny):
    """Issue #48: such a window keeps the whole prompt, and the report said 'ratio 0.5'."""
    ids = _ids(40)
    expected = tiny(ids).logits
    for request in ({"ratio": 0.5}, {"budget": 30}):
        with kvruntime.compress(tiny, "snapkv", options={"window": 64}, **request) as session:
            with pytest.raises(KVRuntimeError, match=r"window of 64 recent tokens is longer than the prompt \(40"):
                session.prefill(ids)
    with kvruntime.compress(tiny, "snapkv", budget=41) as session:
        with pytest.raises(KVRuntimeError, match=r"budget 41 tokens per layer is larger than the prompt \(40"):
            session.prefill(ids)
    assert torch.equal(tiny(ids).logits, expected)
    with kvruntime.compress(tiny, "snapkv", ratio=0.5, options={"window": 40}) as session:  # the whole prompt: kept
        session.prefill(ids)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_float_option_that_is_not_finite_is_refused_by_the_api(tiny, value):
    with pytest.raises(KVRuntimeError, match=f"distilled option leverage={value} is not finite"):
        with kvruntime.compress(tiny, "distilled", ratio=0.5, options={"leverage": value}):
            pass
