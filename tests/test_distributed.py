"""Distributed calibration on tiny models: two gloo ranks on the CPU write the artifacts one process writes, and
ranks started with different settings are refused on every rank, with nothing written."""

import pytest
import torch
import torch.multiprocessing as mp
from distributed_worker import RECIPES, compile_all, rank_main

from kvcompile.calibration.distributed import Shard
from kvruntime.artifacts.artifact import read_artifact


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    threads = torch.get_num_threads()
    try:
        compile_all(folder, Shard())
    finally:
        torch.set_num_threads(threads)
    return folder


def run_ranks(folder, world: int = 2, disagreeing_rank: int = -1) -> None:
    mp.start_processes(rank_main, args=(world, str(folder), disagreeing_rank), nprocs=world, start_method="spawn")


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_write_the_artifacts_one_process_writes(single, tmp_path, world):
    run_ranks(tmp_path, world)
    assert not list(tmp_path.glob("error*.txt")), [p.read_text() for p in tmp_path.glob("error*.txt")]
    for recipe in RECIPES:
        alone, together = (
            read_artifact(single / f"{recipe}.safetensors"),
            read_artifact(tmp_path / f"{recipe}.safetensors"),
        )
        assert alone.kind == together.kind and alone.params == together.params and alone.model == together.model
        assert alone.tensors.keys() == together.tensors.keys()
        for name, tensor in alone.tensors.items():
            assert torch.equal(tensor, together.tensors[name]), (recipe, name)


def test_ranks_that_disagree_on_settings_are_all_refused_and_nothing_is_written(tmp_path):
    run_ranks(tmp_path, disagreeing_rank=1)
    for rank in range(2):
        message = (tmp_path / f"error{rank}.txt").read_text()
        assert message.startswith("the ranks disagree on the settings: rank 1 differs from rank 0 in seed"), message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["error0.txt", "error1.txt"]


def test_ranks_killed_one_step_apart_catch_up_and_resume_to_the_tables_one_process_writes(single, tmp_path):
    """Fault injection: the ranks of a tables run die between their saves around a fit (rank 0 saved after it,
    rank 1 only before it); on resume the laggard takes the leader's tables and the run ends as one process's."""
    from distributed_worker import tables_rank_main

    for stop in (True, False):
        mp.start_processes(tables_rank_main, args=(2, str(tmp_path), stop), nprocs=2, start_method="spawn", join=True)
        if stop:  # the state the catch-up path is for: one checkpoint per rank, one step apart
            progress = [_progress(tmp_path / f"tables.rank{rank}of2.partial") for rank in range(2)]
            assert (progress[0]["round"], progress[0]["phase"], progress[0]["unit"]) == (0, 1, 0)  # saved after the fit
            assert (progress[1]["round"], progress[1]["phase"]) == (0, 0) and progress[1]["unit"] > 0  # only before it
            assert not (tmp_path / "tables.safetensors").exists()
    assert not list(tmp_path.glob("error*.txt")), [p.read_text() for p in tmp_path.glob("error*.txt")]
    alone, resumed = read_artifact(single / "tables.safetensors"), read_artifact(tmp_path / "tables.safetensors")
    for name, tensor in alone.tensors.items():
        assert torch.equal(tensor, resumed.tensors[name]), name


def _progress(checkpoint) -> dict:
    import json

    from safetensors import safe_open

    with safe_open(str(checkpoint), framework="pt") as handle:
        return json.loads(handle.metadata()["progress"])
