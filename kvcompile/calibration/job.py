"""Where and how a compile run works: the model, the artifact's path, and the run's bookkeeping."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torch import nn
from transformers import PreTrainedTokenizerBase

from kvcompile.calibration.distributed import Shard


@dataclasses.dataclass(frozen=True)
class CompileJob:
    model: nn.Module
    tokenizer: PreTrainedTokenizerBase
    out: Path  # the artifact; checkpoints (`--resume`) lie beside it
    resume: bool = False  # continue an interrupted run of the same settings
    checkpoint_every: int = 4  # work items between checkpoints
    shard: Shard = Shard()  # this process's share of the work items (the whole run by default)
