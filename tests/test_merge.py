"""`kvcompile merge`: partial statistics of separate jobs (`--shard i/n`) add up to the artifact of one run; partials
that do not belong together are refused in one line, with nothing written."""

import dataclasses
import re

import pytest
import torch
from distributed_worker import CORPUS, STATS, CharTokenizer, heads_artifact, tiny_model
from typer.testing import CliRunner

from kvcompile.calibration.distributed import Shard, parse_shard
from kvcompile.calibration.job import CompileJob
from kvcompile.cli import app
from kvcompile.recipes.compresskv.layer_errors import compile_layer_errors
from kvcompile.recipes.compresskv.settings import LayerErrorsSettings
from kvcompile.recipes.kvcompose.attention_stats import compile_attention_stats
from kvruntime.artifacts.artifact import read_artifact, save_artifact
from kvruntime.errors import KVRuntimeError

runner = CliRunner()


def stats_shards(folder, count, settings=STATS, seed=0):
    paths = []
    for index in range(count):
        shard = Shard(index, count)
        artifact = compile_attention_stats(
            CompileJob(tiny_model("llama", seed), CharTokenizer(), folder / "run", shard=shard), CORPUS, settings
        )
        paths.append(save_artifact(artifact, folder / f"stats{index}of{count}.safetensors"))
    return paths


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return compile_attention_stats(
        CompileJob(tiny_model("llama"), CharTokenizer(), tmp_path_factory.mktemp("w") / "x"), CORPUS, STATS
    )


def merge(*paths, out):
    return runner.invoke(app, ["merge", *map(str, paths), "--out", str(out)])


def assert_same_artifact(merged, whole):
    assert merged.kind == whole.kind and merged.params == whole.params
    for name, tensor in whole.tensors.items():
        assert torch.equal(tensor, merged.tensors[name]), name


def test_shards_merged_at_once_or_in_steps_give_the_artifact_of_one_run(tmp_path, whole):
    a, b, c = stats_shards(tmp_path, 3)
    partial = read_artifact(a)
    assert partial.kind == "partial_statistics" and partial.params["shards"] == ["0/3"]
    assert partial.tensors["items_done"].tolist() == [1, 0, 0, 1, 0]
    result = merge(a, b, c, out=tmp_path / "stats.safetensors")
    assert result.exit_code == 0, result.output
    assert_same_artifact(read_artifact(tmp_path / "stats.safetensors"), whole)
    assert (tmp_path / "stats.png").exists()
    steps = merge(c, a, out=tmp_path / "ac.safetensors")
    assert "partial statistics (3 of 5 items)" in steps.output
    assert merge(tmp_path / "ac.safetensors", b, out=tmp_path / "stepwise.safetensors").exit_code == 0
    assert_same_artifact(read_artifact(tmp_path / "stepwise.safetensors"), whole)


def test_a_budgets_shard_holds_only_its_prompts(tmp_path):
    model = tiny_model("llama")
    settings = LayerErrorsSettings(prompts=4, prompt_tokens=64, new_tokens=3, seed=0)
    half = compile_layer_errors(
        CompileJob(model, CharTokenizer(), tmp_path / "b", shard=Shard(1, 2)), CORPUS, heads_artifact(model), settings
    )
    assert half.tensors["items_done"].tolist() == [0, 1, 0, 1]
    assert half.params["statistics_of"] == "layer_budgets"


@pytest.mark.parametrize(
    "other, message",
    [
        (lambda folder: stats_shards(folder, 2, dataclasses.replace(STATS, seed=5))[1], "they differ in seed"),
        (lambda folder: stats_shards(folder, 2, seed=1)[1], "they differ in model weights_hash"),
        (lambda folder: stats_shards(folder, 2)[0], "the partial statistics overlap: items [0, 2, 4]"),
        (
            lambda folder: save_artifact(
                compile_layer_errors(
                    CompileJob(tiny_model("llama"), CharTokenizer(), folder / "b", shard=Shard(1, 2)),
                    CORPUS,
                    heads_artifact(tiny_model("llama")),
                    LayerErrorsSettings(prompts=4, prompt_tokens=64, new_tokens=3, seed=0),
                ),
                folder / "budgets.safetensors",
            ),
            "holds statistics of 'layer_budgets'",
        ),
        (lambda folder: folder / "missing.safetensors", "no such artifact file"),
    ],
)
def test_partials_that_do_not_belong_together_are_refused_and_nothing_is_written(tmp_path, other, message):
    first = stats_shards(tmp_path, 2)[0]
    (tmp_path / "other").mkdir()
    second = other(tmp_path / "other")
    before = sorted(tmp_path.iterdir())
    result = merge(first, second, out=tmp_path / "merged.safetensors")
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1
    assert sorted(tmp_path.iterdir()) == before


def test_a_finished_artifact_is_not_merged(tmp_path, whole):
    path = save_artifact(whole, tmp_path / "whole.safetensors")
    result = merge(path, stats_shards(tmp_path, 2)[1], out=tmp_path / "merged.safetensors")
    assert result.exit_code == 2 and "is not partial statistics" in result.output


@pytest.mark.parametrize("text, message", [("2/2", "i must lie in [0, n)"), ("one", "write it as i/n")])
def test_bad_shards_are_refused(text, message):
    with pytest.raises(KVRuntimeError, match=re.escape(message)):
        parse_shard(text)
