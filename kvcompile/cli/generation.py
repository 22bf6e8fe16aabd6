"""`kvcompile generate`: its inputs checked and its compression request resolved without torch (prompts, method,
options, artifacts, tuned defaults: one torch-free place), then the prompts encoded and answered by the runtime."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcompile import recipe, settings
from kvruntime import KVRuntimeError
from kvruntime.artifacts.artifact_header import headers_read_once
from kvruntime.errors import printable
from kvruntime.registry import SAVED_CONTEXT_METHOD, methods_help

if TYPE_CHECKING:
    from kvruntime.methods.resolved import ResolvedRequest


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """`kvcompile generate`'s options, each declared once (`kvcompile.settings.option`)."""

    prompt_file: list[Path] | None = settings.option(
        None,
        "Text file holding the prompt (the context in question mode). Repeat it for several prompts, or give a .jsonl "
        'file of prompts (a JSON string or {"prompt": ...} per line).',
    )
    method: str | None = settings.option(
        None,
        f"{methods_help()}. Default: the method and ratio of the model's tuned_defaults artifact (`kvcompile tune`, "
        "or shipped) if there is one, else kvcompress.",
    )
    ratio: float | None = settings.option(None, "Fraction of cache entries removed, in [0, 1) (default 0.5).")
    budget: int | None = settings.option(None, "Tokens kept per layer (instead of --ratio).")
    question: list[str] | None = settings.option(
        None, "Question mode: compress the prompt without the question, then answer each --question."
    )
    save_context: Path | None = settings.option(
        None,
        "Write the prompt's compressed context (question mode's: one prompt file) to this file, which --context "
        f"answers from later without the document. Default method there: {SAVED_CONTEXT_METHOD} (the most faithful "
        "measured; its two-pass teacher, --option scores=oracle, only on repeated text: docs/usage.md).",
    )
    context: Path | None = settings.option(
        None,
        "Answer each --question from a context file (--save-context's), without the document: no prompt file, "
        "method or ratio (the file holds them); the model it was made from.",
    )
    memory: str = settings.option("padded", "padded (default) or masked: how per-head counts are stored.")
    artifact: list[Path] | None = settings.option(
        None,
        "Compiled artifact(s), or a bundle (its folder or hub repo id, from `kvcompile bundle`), checked against the "
        "model.",
    )
    force: bool = settings.option(False, "Apply artifacts of another checkpoint of the same shape.")
    nearest_budget: bool = settings.option(
        False,
        "compilerkv: use the tables of the nearest compiled budget for a --budget not compiled (a --ratio always does).",
    )
    option: list[str] | None = settings.option(
        None, "A method option as key=value, e.g. mode=dynamic or unstructured=true for kvcompose."
    )
    model: str = settings.model_option()
    dtype: str = settings.dtype_option()
    prompt_format: str = settings.prompt_format_option()
    max_new_tokens: int = settings.option(32, "Tokens to generate.")
    prefill_chunk_size: int | None = settings.option(
        None,
        "Feed the prompt in chunks of this many tokens, every layer cut to its budget after each: the cache held never "
        "exceeds the budgets plus one chunk (methods whose layer budgets are known in advance).",
    )
    batch_size: int = settings.option(
        1,
        "Prompts generated together (left-padded): each row is compressed as it would be alone, and the batch decodes "
        "at once.",
    )
    kv_bits: int | None = settings.option(
        None, "Quantize the kept entries for decoding: 8 (FP8, built in) or 4 (int4, needs optimum-quanto)."
    )


def read_text(path: Path, what: str = "prompt file") -> str:
    """A UTF-8 text file's text; `what` names it in the one-line refusals."""
    if path.is_dir():
        raise KVRuntimeError(f"{what} {path} is a folder: give a text file")
    if not path.exists():
        raise KVRuntimeError(f"{what} {path} does not exist")
    if not path.is_file():
        raise KVRuntimeError(f"{what} {path} is not a regular file (a device or a pipe): give a text file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KVRuntimeError(f"{what} {path} is not UTF-8 text") from None
    if not text.strip():
        raise KVRuntimeError(f"{what} {path} is empty")
    return text


def read_prompts(paths: list[Path]) -> list[tuple[str, str]]:
    """(name, text) of every prompt: a text file is one prompt ("prompt file <path>"); a .jsonl file holds one per
    line, as a JSON string or an object with a "prompt" string ("prompt <path>:<line>")."""
    prompts = []
    for path in paths:
        text = read_text(path)
        if path.suffix != ".jsonl":
            prompts.append((f"prompt file {path}", text))
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except (ValueError, RecursionError) as exc:  # a number past Python's digits, nesting past its stack
                why = "is not JSON" if isinstance(exc, json.JSONDecodeError) else "is JSON past Python's limits"
                raise KVRuntimeError(f"line {number} of {path} {why}: give one prompt per line") from None
            prompt = item.get("prompt") if isinstance(item, dict) else item
            if not isinstance(prompt, str) or not prompt.strip():
                raise KVRuntimeError(
                    f'line {number} of {path} holds no prompt: write a JSON string or {{"prompt": "..."}}'
                )
            check_encodable(f"line {number} of {path}", prompt)
            prompts.append((f"prompt {path}:{number}", prompt))
    return prompts


def check_encodable(what: str, text: str) -> None:
    """Refuse text that is not Unicode a tokenizer can take: a lone surrogate (a JSON escape, or bytes of another
    encoding on the command line)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise KVRuntimeError(f"{what} holds a lone surrogate (not Unicode text): give UTF-8 text") from None


def check_context_target(path: Path, prompts: int, kv_bits: int | None) -> None:
    """Refuse a --save-context that cannot be written as asked: one prompt's context, unquantized, to a file."""
    if prompts != 1:
        raise KVRuntimeError(
            f"--save-context saves one document's context: give one prompt file, not {prompts} prompts"
        )
    if kv_bits is not None:
        raise KVRuntimeError("--save-context saves the kept entries unquantized: leave out --kv-bits")
    if path.is_dir() or not path.parent.is_dir():
        raise KVRuntimeError(f"--save-context {path}: give a file in a folder that exists")


# Over three times the default model's longest token (81 bytes: a newline and 80 spaces); byte-level BPE merges stay
# short. A prompt of more bytes than this times the model's positions cannot fit, whatever it says.
MAX_TOKEN_BYTES = 256


def check_prompt_bytes(name: str, text: str, limit: int | None) -> None:
    """Refuse, before tokenizing it, a prompt too long in bytes to fit in `limit` positions."""
    size = len(text.encode("utf-8"))
    if limit is not None and size > MAX_TOKEN_BYTES * limit:
        raise KVRuntimeError(
            f"{name} is {size:,} bytes: more than the model's {limit:,} positions can hold (at most "
            f"{MAX_TOKEN_BYTES} bytes per token)"
        )


def check_generation_inputs(prompts: Sequence[tuple[str, str]], given: GenerateOptions) -> int | None:
    """Refuse what `generate` cannot run, before torch: returns the model's positions (None: not stated)."""
    from kvcompile.prompt_format import check_prompt_format
    from kvruntime.models.model_spec import check_model_spec, check_positions, check_request_fits, model_facts
    from kvruntime.plumbing.quantized_cache import check_kv_bits

    if given.batch_size < 1:
        raise KVRuntimeError(f"--batch-size {given.batch_size}: give at least 1 prompt per batch")
    check_prompt_format(given.prompt_format)
    check_model_spec(given.model)
    recipe.check_dtype_name(given.dtype)
    facts = model_facts(given.model)  # from the model's config or GGUF header, read once
    batched = given.batch_size > 1 and len(prompts) > 1
    check_request_fits(facts, given.kv_bits is not None, batched, given.prompt_format == "chat")
    positions = facts.positions
    if given.max_new_tokens < 1:
        raise KVRuntimeError(f"--max-new-tokens {given.max_new_tokens}: give at least 1 token to generate")
    check_positions(given.max_new_tokens, positions, f"--max-new-tokens {given.max_new_tokens}")
    for name, text in prompts:
        check_prompt_bytes(name, text, positions)
    if given.prefill_chunk_size is not None and given.prefill_chunk_size < 1:
        raise KVRuntimeError(f"--prefill-chunk-size {given.prefill_chunk_size}: give a positive number of tokens")
    check_kv_bits(given.kv_bits)
    if given.kv_bits is not None and given.batch_size > 1:
        raise KVRuntimeError("--kv-bits quantizes one prompt at a time: leave --batch-size at 1")
    if given.save_context is not None:
        check_context_target(given.save_context, len(prompts), given.kv_bits)
    if given.question is not None and not all(text.strip() for text in given.question):
        raise KVRuntimeError("--question is empty: give the text of each question")
    for text in given.question or []:
        check_encodable("--question", text)
    return positions


@headers_read_once()  # the headers resolution read are the ones the build and the model check read
def compression_asked(given: GenerateOptions, options: dict[str, object], positions: int | None) -> ResolvedRequest:
    """A generate request resolved once, without torch (`kvruntime.methods.resolved.resolve_request`, from the
    model's artifact folders where no artifact is given), then the method built from its artifacts, before the
    model loads."""
    from kvcompile.cli.compile_plan import compile_hint
    from kvruntime.artifacts.bundle import artifact_files
    from kvruntime.methods.resolved import MissingArtifacts, resolve_request
    from kvruntime.models.model_spec import check_positions

    if options and given.method is None:
        raise KVRuntimeError("--option needs --method: options belong to a method")
    if given.budget is not None:
        check_positions(given.budget, positions, f"--budget {given.budget} tokens per layer")
    paths = artifact_files(given.artifact or [])  # a bundle (folder or hub id) gives its artifacts
    try:
        resolved = resolve_request(
            given.method,
            given.ratio,
            given.budget,
            given.memory,
            paths,
            options,
            given.prefill_chunk_size,
            given.kv_bits,
            default_ratio=0.5,
            artifact_folders=() if paths else recipe.artifact_folders(given.model),  # the model's own, unless given
            nearest_budget=given.nearest_budget,
        )
    except MissingArtifacts as exc:
        raise KVRuntimeError(
            f"{exc} (looked for {model_artifacts_described(given.model)}): compile them with "
            f"`{compile_hint(given.model, [exc.method])}`, or pass --artifact"
        ) from None
    _ = resolved.method  # built now: its artifacts' tensors checked (torch, not the model) before the model loads
    given_files = [artifact.path for artifact in resolved.artifacts if artifact.path is not None]
    recipe.refuse_other_models_artifacts(given.model, given_files, force=given.force)  # before the weights load
    return resolved


def model_artifacts_described(model: str) -> str:
    """Where a model's artifacts were looked for, for a refusal: the weights' fingerprint and the folders."""
    identity = recipe.model_identity(model)
    weights = f"{identity.architecture} weights {identity.weights_hash}" if identity is not None else printable(model)
    return f"{weights} in {' and '.join(str(folder) for folder in recipe.artifact_folders(model))}"


Encoded = tuple[str, Any, list[Any]]  # a prompt's name, its ids, and in question mode each question's ids after it


def encoded_prompts(
    tokenizer: Any,
    prompts: Sequence[tuple[str, str]],
    question: Sequence[str] | None,
    chat: bool,
    max_new_tokens: int,
    limit: int | None,
) -> list[Encoded]:
    """Every prompt's ids, checked before the first is answered: a batch is refused whole or answered whole. Chat:
    a prompt is the user's turn, stripped as a chat front end sends it; raw: the text as it is. Question mode: the
    context inside the user's turn, then per question its ids after that context."""
    import torch

    from kvcompile.prompt_format import chat_frame, prompt_ids
    from kvruntime.models.model_spec import check_positions

    turn_start, turn_end = chat_frame(tokenizer) if chat else ("", "")

    def encode(text: str, whole: bool = False) -> Any:  # a whole prompt: Gemma's <bos> first
        return torch.tensor(prompt_ids(tokenizer, text, whole))

    encoded = []
    for name, text in prompts:
        context = text.strip() if chat else text
        if len(encode(context)) < 2:
            raise KVRuntimeError(f"{name} holds fewer than 2 tokens: nothing to compress")
        if question is not None:
            row = encode(turn_start + context, whole=True)
            separator = question_separator(context, chat)
            asked = [encode(separator + q.strip() + turn_end) for q in question]
        else:
            row, asked = encode(turn_start + context + turn_end, whole=True), []
        tokens = len(row) + max((len(ids) for ids in asked), default=0)
        check_positions(tokens + max_new_tokens, limit, f"{name} ({tokens} tokens) and {max_new_tokens} new tokens")
        encoded.append((name, row, asked))
    return encoded


def padding_and_greedy(tokenizer: Any, max_new_tokens: int) -> tuple[int, dict[str, Any]]:
    """A batch's padding token (the tokenizer's own, else its end of text: most causal LMs have no pad token) and
    greedy generation's arguments."""
    pad = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    return pad, dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)


def question_separator(context: str, chat: bool) -> str:
    """What goes between a context and a question's text: a blank line in a chat turn, else a line break unless
    the context ends with white space."""
    return "\n\n" if chat else ("" if context[-1].isspace() else "\n")


def generate_compressed(
    asked: ResolvedRequest, prompts: Sequence[tuple[str, str]], given: GenerateOptions, echo: Callable[[str], None]
) -> None:
    """Load the model, encode the prompts, and answer them in batches of `given.batch_size` under
    `kvruntime.compress`, each batch followed by its compression report."""
    import sys

    import kvruntime
    from kvcompile.prompt_format import uses_chat
    from kvruntime.models.model_spec import loaded_position_limit
    from kvruntime.plumbing.batch_rows import left_pad

    max_new_tokens, batch_size = given.max_new_tokens, given.batch_size
    question = [] if given.question is None and given.save_context is not None else given.question
    loaded, tokenizer = recipe.load_model(given.model, dtype=given.dtype)
    tokenizer.model_max_length = sys.maxsize  # `encoded_prompts` refuses one past the positions, in one line
    limit = loaded_position_limit(loaded.config)
    chat = uses_chat(tokenizer, given.prompt_format)
    encoded = encoded_prompts(tokenizer, prompts, question, chat, max_new_tokens, limit)
    pad, greedy = padding_and_greedy(tokenizer, max_new_tokens)

    def show(name: str, text: str) -> None:
        if len(encoded) > 1:
            echo(f"== {name}")
        echo(text)

    def decoded(ids: Any) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True).strip()

    with kvruntime.compress(loaded, asked, force=given.force) as session:
        for first in range(0, len(encoded), batch_size):
            batch = encoded[first : first + batch_size]
            ids, mask = left_pad([row for _, row, _ in batch], pad)
            if question is not None:
                compressed = session.prefill(ids, attention_mask=mask)
                if given.save_context is not None:  # one prompt (`check_generation_inputs`)
                    separator = question_separator(prompts[0][1], chat)  # in a chat turn whatever the text ends with
                    saved = kvruntime.save_context(
                        compressed, given.save_context, tokenizer, "chat" if chat else "raw", separator
                    )
                    echo(f"saved the compressed context to {saved} ({saved.stat().st_size / (1 << 20):.2f} MiB)")
                answers: list[list[str]] = [[] for _ in batch]
                for number, text in enumerate(question):
                    question_ids, question_mask = left_pad([questions[number] for _, _, questions in batch], pad)
                    output = compressed.generate(question_ids, attention_mask=question_mask, **greedy)
                    for lines, answer in zip(answers, output[:, question_ids.shape[1] :]):
                        lines.append(f"Q: {text.strip()}\nA: {decoded(answer)}")
                for (name, _, _), lines in zip(batch, answers):
                    if lines:
                        show(name, "\n".join(lines))
            else:
                output = loaded.generate(input_ids=ids, attention_mask=mask, **greedy)
                for (name, _, _), answer in zip(batch, output[:, ids.shape[1] :]):
                    show(name, decoded(answer))
            echo(str(session.batch_report if len(batch) > 1 else session.report))
