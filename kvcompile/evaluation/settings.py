"""What an evaluation run (`kvcompile eval`, and `kvcompile tune`'s validation) asks for, checked without torch:
ratios, and the built-in suite's tasks, lengths and samples or a user's own suite (`tasks/own_suite.py`). The run
itself is in `suite_run.py`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from kvcompile.prompt_format import check_prompt_format
from kvcompile.tasks.grid import check_tasks
from kvcompile.tasks.scoring import SCORINGS
from kvruntime import KVRuntimeError
from kvruntime.models.model_spec import check_positions

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
    suite: str | None = None  # a user's suite (a JSON Lines file or a datasets folder) instead of the tasks
    suite_sha256: str | None = None  # the digest of the bytes its rows come from: a resumed run reads the same rows
    scoring: str = "all"  # how its answers are scored (`scoring.SCORINGS`); the built-in tasks' is "all"

    @property
    def samples_per_task(self) -> dict[str, int]:
        return {task: self.task_samples.get(task, self.samples) for task in self.tasks}

    @property
    def suite_name(self) -> str | None:
        """A user's suite's name in the records (its file's or folder's name, without .jsonl)."""
        return None if self.suite is None else Path(self.suite).name.removesuffix(".jsonl")

    def prompts(self, corpus: Corpus, tokenizer: PreTrainedTokenizerBase, limit: int | None = None) -> list[TaskPrompt]:
        """The run's prompts, in the suite's order (`suite_prompts`), or the user's suite's in its file's order, each
        refused in one line if the model cannot hold it with the answer after it (`limit`: its positions)."""
        if self.suite is None:
            from kvcompile.tasks.suite import suite_prompts

            return suite_prompts(
                corpus, tokenizer, self.tasks, self.lengths, self.samples_per_task, self.seed, self.prompt_format
            )
        from kvcompile.prompt_format import uses_chat
        from kvcompile.tasks.own_suite import read_suite, suite_prompt

        suite = read_suite(Path(self.suite))
        if self.suite_sha256 != suite.sha256:  # what runs is what the run's settings name
            raise KVRuntimeError(f"--suite {self.suite}: changed since the run's settings were made")
        chat = uses_chat(tokenizer, self.prompt_format)
        prompts = []
        for row in suite.rows:
            prompt = suite_prompt(row, tokenizer, chat, self.suite_name, self.scoring, limit)
            tokens = len(tokenizer(prompt.prompt, add_special_tokens=False).input_ids)
            check_positions(tokens + self.new_tokens, limit, f"{row.where}: {tokens} tokens and {self.new_tokens} new")
            prompts.append(prompt)
        return prompts

    def check(self) -> None:
        if not self.ratios or any(not 0.0 < r < 1.0 for r in self.ratios):
            raise KVRuntimeError(f"--ratios {list(self.ratios)}: give compression ratios in (0, 1)")
        check_prompt_format(self.prompt_format)
        if self.samples < 1 or self.new_tokens < 1:
            raise KVRuntimeError("--samples and --new-tokens must be at least 1")
        if self.scoring not in SCORINGS:
            raise KVRuntimeError(f"--scoring {self.scoring!r}: use one of {', '.join(SCORINGS)}")
        if self.suite is None:  # a user's suite: its rows were checked when its digest was made (read_suite)
            check_tasks(self.tasks)

    def check_positions(self, limit: int | None) -> None:
        """Refuse lengths the model cannot hold with the answer after them (`limit`: its positions; None: not
        known). A user's suite is checked prompt by prompt once tokenized (`prompts`)."""
        if self.suite is not None:
            return
        check_positions(
            max(self.lengths) + self.new_tokens,
            limit,
            f"--lengths {max(self.lengths)} and {self.new_tokens} new tokens",
        )

    def record(self) -> dict[str, object]:
        """The settings as a run's records hold them: those of a user's suite only when it has one (runs recorded
        before them stay resumable)."""
        record = dataclasses.asdict(self)
        if self.suite is None:
            for key in ("suite", "suite_sha256", "scoring"):
                del record[key]
        return record
