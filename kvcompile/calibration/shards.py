"""Which share of a compile run's work items a process takes, torch-free: shard i of n takes the items i, i + n,
i + 2n, ... The command line reads `--shard i/n` and torchrun's rank with these before it imports anything heavy;
`distributed.py` joins the process group and adds the shares up."""

from __future__ import annotations

import dataclasses
import os

from kvruntime import KVRuntimeError

PARTIAL_KIND = "partial_statistics"  # what a share of a split run writes (`kvcompile merge` adds them up)


@dataclasses.dataclass(frozen=True)
class Shard:
    index: int = 0
    count: int = 1
    in_process_group: bool = False

    def items(self, total: int) -> range:
        return range(self.index, total, self.count)

    @property
    def is_whole(self) -> bool:
        return self.count == 1

    @property
    def writes_results(self) -> bool:
        """In a process group only rank 0 writes; every separate job writes its own partial statistics."""
        return not self.in_process_group or self.index == 0

    def describe(self) -> str:
        return f"{self.index}/{self.count}"


def shard_from_text(text: str) -> Shard:
    """`--shard i/n` of a separate job."""
    index, _, count = text.partition("/")
    try:
        shard = Shard(int(index), int(count))
    except ValueError:
        raise KVRuntimeError(f"--shard {text!r}: write it as i/n, e.g. 0/4 for the first of four jobs") from None
    if not 0 <= shard.index < shard.count:
        raise KVRuntimeError(f"--shard {text!r}: i must lie in [0, n)")
    return shard


def planned_shard(text: str | None) -> Shard:
    """The share this process will take, from `--shard` or torchrun's environment (RANK of WORLD_SIZE), before the
    process group is joined."""
    if text is not None:
        return shard_from_text(text)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return Shard(int(os.environ.get("RANK", "0")), world, in_process_group=True) if world > 1 else Shard()
