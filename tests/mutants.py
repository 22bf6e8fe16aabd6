"""Replays realistic mutants of the code against the fast tests (issue #78): each mutant applied alone to a scratch
copy of the checkout, then `make test-fast`'s files run there, stopping at the first failure. One line per mutant:
caught (a test failed) or SURVIVED; exits 1 when any survives, or when a mutant no longer applies (the code it
mutates moved: update it here).

    python tests/mutants.py              # every mutant (`make mutants`)
    python tests/mutants.py bos f1       # those whose name contains one of the words

The scratch copy is the checkout's tracked and untracked files (what git does not ignore); the copy is imported
first (`PYTHONPATH`), ahead of the editable install."""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the checkout
    original: str  # exactly once in the file
    mutated: str


MUTANTS = [
    # Issue #78's table: what a broken second model looks like.
    Mutant(
        "sliding storage trimmed before attention",
        "runtime/kvruntime/engine/session.py",
        "module.register_forward_hook(self._after_window_attention, with_kwargs=True)",
        "module.register_forward_pre_hook(lambda m, a, k: self._after_window_attention(m, a, k, None), "
        "with_kwargs=True)",
    ),
    Mutant(
        "sliding storage trimmed before attention, once it holds entries",
        "runtime/kvruntime/engine/session.py",
        "module.register_forward_hook(self._after_window_attention, with_kwargs=True)",
        "module.register_forward_pre_hook(lambda m, a, k: self._after_window_attention(m, a, k, None) "
        "if hooked_cache(k).layers[m.layer_idx].is_initialized else None, with_kwargs=True)",
    ),
    Mutant(
        "eval context without bos",
        "kvcompile/evaluation/runner.py",
        "return torch.tensor([prompt_ids(tokenizer, text, whole)])",
        "return torch.tensor([prompt_ids(tokenizer, text, False)])",
    ),
    Mutant(
        "generate --question without bos",
        "kvcompile/cli/generation.py",
        "row = encode(turn_start + context, whole=True)",
        "row = encode(turn_start + context)",
    ),
    Mutant(
        "srh probe answer positions not shifted by bos",
        "kvcompile/tasks/needles.py",
        'shift = len(ids) - len(encoded["input_ids"])',
        "shift = 0",
    ),
    Mutant(
        "a tokenizer asking for bos without adding it gets none",
        "kvcompile/prompt_format.py",
        'if not opening and getattr(tokenizer, "add_bos_token", False) and bos is not None:',
        "if False:",
    ),
    Mutant(
        "gguf tokenizer without bos",
        "runtime/kvruntime/models/gguf_tokenizer.py",
        "    if spec.add_bos:\n        bos = spec.tokens[spec.bos_id]",
        "    if False:\n        bos = spec.tokens[spec.bos_id]",
    ),
    Mutant(
        "card yaml by string formatting",
        "kvcompile/bundle.py",
        'yaml.safe_dump(metadata, sort_keys=False, allow_unicode=False).rstrip("\\n")',
        '"\\n".join(f"{key}: {value}" for key, value in metadata.items())',
    ),
    Mutant(
        "tuned default's artifacts read again when given",
        "runtime/kvruntime/methods/resolved.py",
        "files += tuple(path for path in defaults.artifact_files if path.resolve() not in present)",
        "files += tuple(defaults.artifact_files)",
    ),
    Mutant(
        "f1 counts a set",
        "kvcompile/tasks/scoring.py",
        "common = sum((collections.Counter(said) & collections.Counter(wanted)).values())",
        "common = len(set(said) & set(wanted))",
    ),
    # Five of our own, on the model layout and attention of issue #77.
    Mutant(
        "layout numbers the cut layers from 0",
        "runtime/kvruntime/models/layout.py",
        "return tuple(index for index, kind in enumerate(self.kinds) if kind == GROWING)",
        "return tuple(range(sum(kind == GROWING for kind in self.kinds)))",
    ),
    Mutant(
        "final soft cap skipped",
        "runtime/kvruntime/models/layout.py",
        "return soft_capped(logits, self.final_softcap)",
        "return logits",
    ),
    Mutant(
        "attention sinks left out of the softmax",
        "runtime/kvruntime/math/attention_logits.py",
        "        if self.sinks is None:\n            return logits.softmax(dim=-1)",
        "        if True:\n            return logits.softmax(dim=-1)",
    ),
    Mutant(
        "sinks' weight kept",
        "runtime/kvruntime/math/attention_logits.py",
        "return torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]",
        "return torch.cat([logits, sink], dim=-1)[..., :-1].softmax(dim=-1)",
    ),
    Mutant(
        "sliding band off by one",
        "runtime/kvruntime/math/attention_logits.py",
        "diagonal=kv_len - q_len - band + 1",
        "diagonal=kv_len - q_len - band",
    ),
    Mutant(
        "sentencepiece merges in another order",
        "runtime/kvruntime/models/gguf_tokenizer.py",
        "key=lambda pair: (-len(pair[0]), -len(pair[1]), rank[pair[0]], rank[pair[1]])",
        "key=lambda pair: (rank[pair[0]], rank[pair[1]])",
    ),
    # Found on the way: a tuned default named the shipped artifacts by ../ (the runtime refused it).
    Mutant(
        "tune copies over another file of an artifact's name",
        "kvcompile/recipes/tuned_defaults/recipe.py",
        "if target.exists() and not filecmp.cmp(target, path, shallow=False):",
        "if False:",
    ),
]


def fast_tests() -> list[str]:
    """`make test-fast`'s files, as the Makefile lists them."""
    listed = subprocess.run(
        ["make", "-s", "--no-print-directory", "-f", "Makefile", "-f", "-", "print-fast"],
        input="print-fast:\n\t@echo $(addsuffix .py,$(FAST_TESTS))\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    return listed.stdout.split()


def scratch_copy(into: Path) -> None:
    """The checkout's files that git tracks or would track (untracked, not ignored) copied into `into`."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        cwd=ROOT,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        source, target = ROOT / name.decode(), into / name.decode()
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def run(mutant: Mutant, scratch: Path, tests: list[str]) -> str:
    path = scratch / mutant.path
    source = path.read_text()
    if source.count(mutant.original) != 1:
        return "NO LONGER APPLIES"
    path.write_text(source.replace(mutant.original, mutant.mutated))
    try:
        environment = {**os.environ, "PYTHONPATH": f"{scratch}{os.pathsep}{scratch / 'runtime'}"}
        command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not integration"]
        result = subprocess.run([*command, *tests], cwd=scratch, env=environment, capture_output=True, text=True)
    finally:
        path.write_text(source)
    return "caught" if result.returncode != 0 else "SURVIVED"


def main() -> None:
    wanted = sys.argv[1:]
    chosen = [m for m in MUTANTS if not wanted or any(word in m.name for word in wanted)]
    tests = fast_tests()
    bad = 0
    with tempfile.TemporaryDirectory(prefix="kvcompile-mutants-") as folder:
        scratch = Path(folder)
        scratch_copy(scratch)
        for mutant in chosen:
            started = time.perf_counter()
            verdict = run(mutant, scratch, tests)
            bad += verdict != "caught"
            print(f"{verdict:>17}  {time.perf_counter() - started:5.0f} s  {mutant.name} ({mutant.path})", flush=True)
    print(f"{len(chosen) - bad} of {len(chosen)} caught by `{shlex.join(['pytest', *tests])}`"[:200])
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
