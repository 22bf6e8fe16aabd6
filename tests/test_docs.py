"""The docs name what exists (issue #77): every Python file they quote in backticks, by path or by name, is one of
the project's (a quoted file once named `budgets.py`, which no longer existed)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "runtime" / "README.md"]
# Names the docs quote as examples of a hostile bundle's files, not as the project's.
NOT_THE_PROJECTS = {"typer.py", "torch.py"}
QUOTED = re.compile(r"`([A-Za-z0-9_./-]+\.py)(?::[0-9-]+)?`")


def test_every_python_file_the_docs_quote_exists():
    files = [
        path.relative_to(ROOT).as_posix()
        for path in ROOT.rglob("*.py")
        if not {".venv", ".venv-bench"} & set(path.relative_to(ROOT).parts)
    ]
    names = {file.rsplit("/", 1)[-1] for file in files}
    missing = []
    for doc in DOCS:
        for quoted in QUOTED.findall(doc.read_text()):
            found = (
                any(file == quoted or file.endswith("/" + quoted) for file in files)
                if "/" in quoted
                else quoted in names
            )
            if not found and quoted not in NOT_THE_PROJECTS:
                missing.append(f"{doc.relative_to(ROOT)}: {quoted}")
    assert missing == []
