"""Real text that no compile command reads (`calibration_data/held_out/`): Python source, the Python language
reference and a second book (Stevenson's Jekyll and Hyde), each asked about in ways its own structure gives (no
model writes a question) and continued with its real next tokens, so that each text type is judged on its own
(issue #63). Questions come after the context, as every task's do: question-agnostic compression cuts the context
before it sees them.

- `code_signature`: the parameters of a function defined in the window (its `def` nearest the depth), read with a
  regular expression;
- `docs_sentence`, `jekyll_sentence`: the rest of a sentence of the window (the one nearest the depth) whose first
  half the question quotes;
- `code_continuation`, `docs_continuation`, `jekyll_continuation`: the window cut at its end, the real next
  `CONTINUATION_TOKENS` tokens the expected answer (its log-probability is the fidelity measure the task is for).

Answers are scored by token F1 (SQuAD's, on the answer's first line): a parameter list or half a sentence said in
other spacing still counts."""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from kvcompile.calibration.corpus import Corpus, load_corpus, passage_ids
from kvcompile.shipped import shipped_folder
from kvcompile.tasks.needles import paragraph_start, render_prompt
from kvcompile.tasks.retrieval import TaskPrompt
from kvruntime import KVRuntimeError

HELD_OUT_FILES = {"code": "code_*.txt.gz", "docs": "docs_*.txt.gz", "jekyll": "prose_jekyll_hyde.txt.gz"}
CONTINUATION_TOKENS = 48
QUESTION = "\n\nAnswer the question about the text above. Question: {question}"
CONTINUE = "\n\nContinue the text above from the exact point where it stops: write the next few lines only."
SIGNATURE_QUESTION = "What are the parameters of the function `{name}` defined above? Answer with its parameter list."
SENTENCE_QUESTION = 'A sentence above begins "{start}". How does it end? Answer with the rest of the sentence.'
_DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(\w+)\(([^()]*)\)", re.MULTILINE)
_SENTENCE = re.compile(r"[A-Z][^.!?]{40,300}[.!?](?=\s)")
_QUESTION_ROOM = 48  # tokens of a prompt left to its question and the chat template
_DRAWS = 8  # windows drawn for a question before a prompt is refused (a window without a def or a sentence)


@functools.cache
def held_out_text(kind: str) -> Corpus:
    """The shipped held-out text of one kind (`HELD_OUT_FILES`), a document a file."""
    files = sorted((shipped_folder("calibration_data") / "held_out").glob(HELD_OUT_FILES[kind]))
    return Corpus(f"held-out {kind}", tuple(load_corpus(path).documents[0] for path in files))


def _window(kind: str, tokenizer: PreTrainedTokenizerBase, tokens: int, rng: random.Random) -> tuple[str, str]:
    """About `tokens` tokens of one held-out document from a random paragraph, and its next CONTINUATION_TOKENS."""
    document, start = paragraph_start(held_out_text(kind), tokens + CONTINUATION_TOKENS, rng)
    ids = passage_ids(tokenizer, document, start, tokens + CONTINUATION_TOKENS)
    return tokenizer.decode(ids[:tokens]), tokenizer.decode(ids[tokens:])


# A task's question from its window, the window's next tokens and the depth: (question, expected answer), or None
# where the window gives none (another is drawn).
Ask = Callable[[str, str, float], "tuple[str, str] | None"]


def continuation(context: str, following: str, depth: float) -> tuple[str, str]:
    """The window's real next tokens."""
    return CONTINUE, following.strip()


def signature_question(context: str, following: str, depth: float) -> tuple[str, str] | None:
    """The `def` nearest `depth` of a function defined once in the window, with at least one parameter besides
    self/cls: the question, and its parameter list (whitespace collapsed)."""
    found = [(m.start(), m.group(1), " ".join(m.group(2).split())) for m in _DEF.finditer(context)]
    names = [name for _, name, _ in found]
    usable = [(at, n, p) for at, n, p in found if names.count(n) == 1 and set(_parameters(p)) - {"self", "cls"}]
    if not usable:
        return None
    _, name, parameters = min(usable, key=lambda f: abs(f[0] - depth * len(context)))
    return QUESTION.format(question=SIGNATURE_QUESTION.format(name=name)), parameters


def _parameters(parameter_list: str) -> list[str]:
    return [part.strip() for part in parameter_list.split(",") if part.strip()]


def sentence_question(context: str, following: str, depth: float) -> tuple[str, str] | None:
    """The sentence nearest `depth` (of 10 to 50 words, mostly letters, its opening unique in the window): the
    question quoting its first half, and the rest."""
    flat = " ".join(context.split())
    candidates = []
    for match in _SENTENCE.finditer(flat):
        words = match.group(0).split()
        letters = sum(w.strip(".,;:!?\"'()").isalpha() for w in words)
        if 10 <= len(words) <= 50 and letters >= 0.8 * len(words):
            start, rest = " ".join(words[: len(words) // 2]), " ".join(words[len(words) // 2 :])
            if flat.count(start) == 1:
                candidates.append((match.start(), start, rest))
    if not candidates:
        return None
    _, start, rest = min(candidates, key=lambda c: abs(c[0] - depth * len(flat)))
    return QUESTION.format(question=SENTENCE_QUESTION.format(start=start)), rest


def real_text_prompt(
    task: str, tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int, chat: bool = True
) -> TaskPrompt:
    """One prompt of a real-text task (`REAL_TEXT_TASKS`): a window of its text and the question its `Ask` derives
    from it, the window's tokens leaving room for the question and the template."""
    kind, ask = task.split("_")[0], REAL_TEXT_TASKS[task]
    rng = random.Random(f"{task}:{seed}:{length}:{depth}")
    for _ in range(_DRAWS):
        context, following = _window(kind, tokenizer, length - _QUESTION_ROOM, rng)
        asked = ask(context, following, depth)
        if asked is not None:
            question, expected = asked
            prompt = render_prompt(tokenizer, context + question, chat)
            return TaskPrompt(task, prompt, (expected,), length, depth, prompt.rindex(question[:40]), scoring="f1")
    raise KVRuntimeError(f"{task}: no window of {length} tokens gave a question in {_DRAWS} draws")


REAL_TEXT_TASKS: dict[str, Ask] = {
    "code_signature": signature_question,
    "docs_sentence": sentence_question,
    "jekyll_sentence": sentence_question,
    "code_continuation": continuation,
    "docs_continuation": continuation,
    "jekyll_continuation": continuation,
}
