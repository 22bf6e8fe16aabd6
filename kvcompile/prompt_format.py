"""How a prompt reaches the model: through its chat template (instruct models) or as raw text (base models)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvruntime import KVRuntimeError

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
        raise KVRuntimeError("the model's tokenizer has no chat template: use --prompt-format raw for a base model")


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
