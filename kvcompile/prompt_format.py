"""How a prompt reaches the model: through its chat template (instruct models) or as raw text (base models)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvruntime import KVRuntimeError
from kvruntime.models.model_spec import NO_CHAT_TEMPLATE

if TYPE_CHECKING:  # the command line checks --prompt-format before it imports transformers
    from transformers import PreTrainedTokenizerBase

PROMPT_FORMATS = ("auto", "chat", "raw")
_CONTENT_MARKER = "\x00kvcompile-user-content\x00"


def check_prompt_format(prompt_format: str) -> None:
    if prompt_format not in PROMPT_FORMATS:
        raise KVRuntimeError(f"--prompt-format {prompt_format!r}: use one of {', '.join(PROMPT_FORMATS)}")


def uses_chat(tokenizer: PreTrainedTokenizerBase, prompt_format: str) -> bool:
    """`chat`, or `auto` with a tokenizer that has a chat template."""
    check_prompt_format(prompt_format)
    return prompt_format == "chat" or (prompt_format == "auto" and bool(getattr(tokenizer, "chat_template", None)))


def require_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise KVRuntimeError(NO_CHAT_TEMPLATE)


def chat_frame(tokenizer: PreTrainedTokenizerBase) -> tuple[str, str]:
    """(before, after): the chat template's text around one user turn's content, the assistant's turn opened, so
    that a context can be compressed inside the turn and each question appended with the turn's end."""
    require_chat_template(tokenizer)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": _CONTENT_MARKER}], tokenize=False, add_generation_prompt=True
    )
    before, marker, after = rendered.partition(_CONTENT_MARKER)
    if not marker:
        raise KVRuntimeError(
            "the model's chat template does not place the user's text verbatim: use --prompt-format raw"
        )
    return before, after


def opening_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids the tokenizer puts before any text it encodes whole (Gemma's `<bos>`, without which it degenerates;
    none for SmolLM2): what a prompt encoded from plain text must start with. A tokenizer that asks for its `<bos>`
    (`add_bos_token`) without adding it (some transformers versions' Gemma converters) gets it all the same."""
    whole, plain = tokenizer("x").input_ids, tokenizer("x", add_special_tokens=False).input_ids
    opening = list(whole[: len(whole) - len(plain)]) if whole[len(whole) - len(plain) :] == plain else []
    bos = getattr(tokenizer, "bos_token_id", None)
    if not opening and getattr(tokenizer, "add_bos_token", False) and bos is not None:
        return [bos]
    return opening


def prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str, whole: bool) -> list[int]:
    """`text`'s ids without the tokenizer's special tokens, after its opening ids where it is a whole prompt (what
    a model reads first), not where it goes after one (a question after its context)."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return opened(tokenizer, ids) if whole else list(ids)


def opened(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[int]:
    """`ids` of a whole prompt, after the tokenizer's opening ids unless they start with them already (a chat
    template that writes its own `<bos>`)."""
    opening = opening_ids(tokenizer)
    return list(ids) if list(ids[: len(opening)]) == opening else [*opening, *ids]
