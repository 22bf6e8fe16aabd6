"""What an evaluation run (`kvcompile eval`, and `kvcompile tune`'s validation) asks for, checked without torch:
ratios, tasks, lengths, samples. The run itself is in `suite_run.py`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvcompile.prompt_format import check_prompt_format
from kvcompile.tasks.grid import check_tasks
from kvruntime import KVRuntimeError
from kvruntime.model_spec import check_positions

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from kvcompile.calibration.corpus import Corpus
    from kvcompile.tasks.retrieval import TaskPrompt


@dataclasses.dataclass(frozen=True)
class SuiteSettings:
    ratios: tuple[float, ...]
    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    samples: int
    seed: int
    question_aware: bool
    new_tokens: int
    prompt_format: str = "auto"
    task_samples: dict[str, int] = dataclasses.field(default_factory=dict)  # tasks given a count of their own

    @property
    def samples_per_task(self) -> dict[str, int]:
        return {task: self.task_samples.get(task, self.samples) for task in self.tasks}

    def prompts(self, corpus: Corpus, tokenizer: PreTrainedTokenizerBase) -> list[TaskPrompt]:
        """The run's prompts, in the suite's order (`suite_prompts`)."""
        from kvcompile.tasks.suite import suite_prompts

        return suite_prompts(
            corpus, tokenizer, self.tasks, self.lengths, self.samples_per_task, self.seed, self.prompt_format
        )

    def check(self) -> None:
        if not self.ratios or any(not 0.0 < r < 1.0 for r in self.ratios):
            raise KVRuntimeError(f"--ratios {list(self.ratios)}: give compression ratios in (0, 1)")
        check_tasks(self.tasks)
        check_prompt_format(self.prompt_format)
        if self.samples < 1 or self.new_tokens < 1:
            raise KVRuntimeError("--samples and --new-tokens must be at least 1")

    def check_positions(self, limit: int | None) -> None:
        """Refuse lengths the model cannot hold with the answer after them (`limit`: its positions; None: not
        known)."""
        check_positions(
            max(self.lengths) + self.new_tokens,
            limit,
            f"--lengths {max(self.lengths)} and {self.new_tokens} new tokens",
        )
