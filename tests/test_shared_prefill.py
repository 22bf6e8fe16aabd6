"""One prefill shared by every contestant of a prompt (`kvcompile eval --shared-prefill`, the default): a method's
hooks run on a recorded plain prefill (`kvruntime.plumbing.recording`) cut what its own prefill cuts, entry for entry, on tiny
Llama, Qwen2 and Qwen3 models, for every method and path the runtime serves but streaming (refused: its later chunks
see what the earlier ones kept); the evaluation's answers from a shared prefill are those of its own prefills."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import compiled_artifacts, tiny_model
from test_batches import CASES, artifacts_for, compress
from test_compilerkv_runtime import save_tables

from kvcompile.evaluation import runner
from kvcompile.evaluation.contestants import FullCache, RuntimeMethod
from kvcompile.evaluation.prefill import shared_prefill
from kvcompile.evaluation.runner import Scoring
from kvruntime import KVRuntimeError, Request
from kvruntime.plumbing.recording import recorded_prefill

LENGTH = 180


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def setup(request, tmp_path_factory):
    model = tiny_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    paths = compiled_artifacts(model, folder, (0.5, 0.75), 256) + [save_tables(model, folder)]
    context = torch.randint(3, 96, (1, LENGTH), generator=torch.Generator().manual_seed(5))
    return model, paths, context


def report_facts(report) -> dict:
    """A compression report without its timings."""
    return {k: v for k, v in vars(report).items() if not k.endswith("_seconds")}


@pytest.mark.parametrize("method, request_, options, chunk", CASES, ids=lambda c: str(c))
def test_a_method_on_a_recorded_prefill_cuts_what_its_own_prefill_cuts(setup, method, request_, options, chunk):
    model, paths, context = setup
    with compress(model, method, request_, options, chunk, paths) as session:
        own = session.prefill(context)
        own_positions = session.kept_positions
        own_masks = own.keep_masks
    recording = recorded_prefill(model, context)
    with compress(model, method, request_, options, chunk, paths) as session:
        if chunk is not None:
            with pytest.raises(KVRuntimeError, match="streamed in chunks"):
                session.compress_recording(recording)
            return
        shared = session.compress_recording(recording)
        assert report_facts(shared.report) == report_facts(own.report)
        for ours, theirs in zip(session.kept_positions, own_positions, strict=True):
            assert torch.equal(ours, theirs)
        for ours, theirs in zip(shared.cache.layers, own.cache.layers, strict=True):
            assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
        assert shared.keep_masks.keys() == own_masks.keys()
        assert all(torch.equal(shared.keep_masks[i], own_masks[i]) for i in own_masks)
    # The recording is the full cache still: another method cuts from it as from a fresh prefill.
    assert all(layer.keys.shape[2] == LENGTH for layer in recording.cache.layers)


def tokenizer() -> SimpleNamespace:
    return SimpleNamespace(eos_token_id=0, decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))


@pytest.mark.parametrize(
    "contestant, ratio",
    [
        (FullCache(), 0.0),
        (RuntimeMethod("kvcompress", "kvcompress"), 0.5),
        (RuntimeMethod("distilled", "distilled"), 0.75),
        (RuntimeMethod("kvcompose", "kvcompose", {"mode": "dynamic"}), 0.5),
        (RuntimeMethod("streamed", "snapkv", prefill_chunk_size=64), 0.5),
    ],
    ids=lambda c: getattr(c, "label", str(c)),
)
def test_the_eval_answers_from_a_shared_prefill_as_from_its_own(setup, contestant, ratio):
    """The full cache, a per-layer cut, a second pass and a streamed method (which prefills alone, shared or not):
    the same answer, logits and bytes held; the shared run's time adds the shared forward to its own hooks'."""
    model, paths, context = setup
    question = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(6))
    scoring = Scoring([7, 3, 9], [11, 12])
    artifacts = artifacts_for(contestant.method, paths) if isinstance(contestant, RuntimeMethod) else []
    contestant = contestant.resolved(artifacts, [Request(ratio=ratio)])  # once for the run, as eval resolves it
    arguments = (model, tokenizer(), contestant, ratio, context, question, 6, artifacts, scoring)
    own = runner.answer(*arguments)
    shared = shared_prefill(model, context)
    replayed = runner.answer(*arguments, shared)
    assert replayed.tokens == own.tokens and replayed.cache_bytes == own.cache_bytes
    assert torch.equal(replayed.first_logits, own.first_logits)
    assert torch.equal(replayed.reference_logits, own.reference_logits)
    assert replayed.gold_logprob == own.gold_logprob
    if getattr(contestant, "prefill_chunk_size", None) is None:
        assert replayed.peak_mib is None and replayed.prefill_seconds > shared.seconds
    else:
        assert replayed.peak_mib is not None  # its own prefill, measured


def test_a_recording_made_inside_a_compress_block_is_refused_in_one_line():
    """Recorded inside a block, the prefill went through the block's cut: its cache holds what was kept, not the
    prompt, and replaying the hooks on it would index entries that are gone."""
    import kvruntime

    model = tiny_model("llama")
    context = torch.randint(3, 96, (1, 64), generator=torch.Generator().manual_seed(6))
    with kvruntime.compress(model, "snapkv", ratio=0.5) as session:
        inside = recorded_prefill(model, context)
        with pytest.raises(KVRuntimeError, match=r"^this recording holds a compressed cache .*before the block$"):
            session.compress_recording(inside)
    outside = recorded_prefill(model, context)
    assert outside.holds_the_whole_prompt() and not inside.holds_the_whole_prompt()
    with kvruntime.compress(model, "snapkv", ratio=0.5) as session:
        assert session.compress_recording(outside).report.slots_per_layer == [32] * 4
