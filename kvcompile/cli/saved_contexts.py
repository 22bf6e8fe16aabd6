"""`kvcompile generate --context FILE --question ...`: questions answered from a compressed context saved by
`--save-context`, without the document. The file's header is checked against the model's fingerprint before the
model loads; then the whole file against the model and its tokenizer before any of it is used
(`kvruntime.load_context`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvcompile import recipe
from kvcompile.cli.generation import GenerateOptions, check_generation_inputs, padding_and_greedy
from kvruntime import KVRuntimeError
from kvruntime.errors import printable

if TYPE_CHECKING:
    from kvruntime.artifacts.context_file import ContextHeader

# What the file decides (the document, and how it was compressed), never given beside it.
DECIDED_BY_THE_FILE = (
    "prompt_file", "method", "ratio", "budget", "artifact", "option", "save_context", "prefill_chunk_size", "kv_bits",
    "nearest_budget",
)  # fmt: skip


def checked_context(given: GenerateOptions) -> tuple[ContextHeader, int | None]:
    """The context file's header, checked without torch: the options beside it, its header, the model it was made
    for against the model's fingerprint (where it can be read before loading), and the positions it takes. Also
    returns the model's positions."""
    from kvruntime.artifacts.context_file import check_context_model, read_context_header
    from kvruntime.models.model_spec import check_positions, check_request_fits, model_facts

    beside = [
        f"--{name.replace('_', '-')}" for name in DECIDED_BY_THE_FILE if getattr(given, name) not in (None, False, [])
    ]
    if beside:
        raise KVRuntimeError(
            f"--context answers from the file, which holds the document and how it was compressed: leave out "
            f"{', '.join(beside)}"
        )
    if not given.question:
        raise KVRuntimeError("--context answers questions: give at least one --question")
    positions = check_generation_inputs([], given)
    batched = given.batch_size > 1 and len(given.question) > 1  # questions padded to one length
    check_request_fits(model_facts(given.model), kv_bits=False, batch=batched, chat=False)
    header = read_context_header(given.context)
    identity = recipe.model_identity(given.model)
    if identity is not None:
        check_context_model(header, identity)
    if given.prompt_format not in ("auto", header.prompt_format):
        raise KVRuntimeError(
            f"--prompt-format {given.prompt_format}: the context was saved in the {header.prompt_format} format"
        )
    check_positions(
        header.context_length + given.max_new_tokens,
        positions,
        f"the saved context ({header.context_length} tokens) and {given.max_new_tokens} new tokens",
    )
    return header, positions


def answer_from_context(
    header: ContextHeader, positions: int | None, given: GenerateOptions, echo: Callable[[str], None]
) -> None:
    """Load the model, then answer each question after the saved context, `given.batch_size` at a time, and say
    what the context holds."""
    import kvruntime
    from kvcompile.prompt_format import chat_frame
    from kvruntime.models.model_spec import check_positions
    from kvruntime.plumbing.batch_rows import left_pad

    loaded, tokenizer = recipe.load_model(given.model, dtype=given.dtype)
    tokenizer.model_max_length = sys.maxsize  # the positions are checked below, in one line
    turn_end = chat_frame(tokenizer)[1] if header.prompt_format == "chat" else ""
    questions = [
        tokenizer(
            header.question_separator + text.strip() + turn_end, return_tensors="pt", add_special_tokens=False
        ).input_ids[0]
        for text in given.question
    ]
    longest = max(len(ids) for ids in questions)
    check_positions(
        header.context_length + longest + given.max_new_tokens,
        positions,
        f"the saved context ({header.context_length} tokens), a {longest}-token question and {given.max_new_tokens} "
        "new tokens",
    )
    pad, greedy = padding_and_greedy(tokenizer, given.max_new_tokens)
    started = time.perf_counter()
    with kvruntime.load_context(loaded, header.path, tokenizer) as context:
        loaded_in = time.perf_counter() - started
        for first in range(0, len(questions), given.batch_size):
            ids, mask = left_pad(questions[first : first + given.batch_size], pad)
            output = context.generate(ids, attention_mask=mask, **greedy)
            for text, answer in zip(given.question[first:], output[:, ids.shape[1] :]):
                echo(f"Q: {text.strip()}\nA: {tokenizer.decode(answer, skip_special_tokens=True).strip()}")
        held = context.bytes_held
    echo(
        f"saved context {header.path}: {printable(header.method)}, {printable(header.requested)}, "
        f"{header.context_length} tokens, {held / (1 << 20):.2f} MiB of keys and values, read and checked in "
        f"{loaded_in * 1e3:.0f} ms (the document not prefilled)"
    )
