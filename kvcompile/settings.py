"""A command's options declared once, as dataclass fields: a compile recipe's settings, a command's inputs or options
(`GenerateOptions`, `EvalOptions`, ...). A field made by `option` (its help, its choices) is a command-line option
(`kvcompile.cli.commands` derives it); the other fields are settings the command line does not set. Torch-free."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

from kvruntime import KVRuntimeError


def option(
    default: Any,
    help: str,
    *,
    choices: tuple | Mapping | None = None,
    flag: str | None = None,
    old_flags: tuple[str, ...] = (),
    argument: bool = False,
) -> Any:
    """A setting the command line sets (`default` `dataclasses.MISSING`: an option it must be given). `choices`: the
    values allowed, or a mapping from the names the command line takes to the values they stand for; `flag`: the
    option's name where it is not the field's (`--prompt-format` for `chat`, `--a/--b` for a flag's two names);
    `old_flags`: its names before a rename, still taken (recorded commands name them); `argument`: a positional
    argument rather than an option."""
    metadata = {"help": help, "choices": choices, "flag": flag, "old_flags": old_flags, "argument": argument}
    return dataclasses.field(default=default, metadata=metadata)


def seed_option() -> Any:
    return option(0, "Seed of the probe/prompt sampling.")


def model_option() -> Any:
    return option(
        "default",
        "A shipped model: 'default' (SmolLM2-135M-Instruct) or 'gemma-3-270m' (Gemma 3 270M, base, hybrid); a GGUF "
        "file, a local model directory, or a cached hub id.",
    )


def prompt_format_option() -> Any:
    return option(
        "auto", "chat (the model's chat template), raw (base models), or auto (chat when the tokenizer has a template)."
    )


def device_option() -> Any:
    return option("cpu", "Where the model runs: cpu, cuda (under torchrun: each rank's cuda:LOCAL_RANK), cuda:N, mps.")


def dtype_option() -> Any:
    return option("float32", "The model's dtype: float32, bfloat16 or float16 (bfloat16: half the memory).")


def prompt_tokens_option(default: int) -> Any:
    return option(default, "Tokens per calibration prompt.")


def scaled_count(count: int, scale: float, least: int, multiple: int = 1) -> int:
    """`count` x `scale` (0-1) as a multiple of `multiple`, at least `least` (`kvcompile compile --minutes`)."""
    return max(least, multiple * round(count * scale / multiple))


def command_line_fields(settings_type: type) -> list[dataclasses.Field]:
    """The settings a command line sets, in their declared order."""
    return [f for f in dataclasses.fields(settings_type) if "help" in f.metadata]


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata["flag"] or "--" + field.name.replace("_", "-")


def command_line_kind(field: dataclasses.Field, kind: Any) -> Any:
    """The type of the field's option: text for a choice's name or a tuple's comma-separated values, else the
    field's own."""
    return str if isinstance(field.metadata["choices"], Mapping) or typing.get_origin(kind) is tuple else kind


def command_line_default(field: dataclasses.Field, kind: Any) -> Any:
    """The field's default as its option reads it: a choice's name, a tuple's values comma-separated (MISSING for
    an option the command line must be given)."""
    if field.default is dataclasses.MISSING:
        return dataclasses.MISSING
    choices = field.metadata["choices"]
    if isinstance(choices, Mapping):
        return next(name for name, value in choices.items() if value == field.default)
    if typing.get_origin(kind) is tuple:
        return ",".join(str(value) for value in field.default)
    return field.default


def comma_separated(text: str, convert: type) -> tuple:
    """The values of a comma-separated option, each as `convert` reads it (refused in one line otherwise)."""
    try:
        return tuple(convert(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise KVRuntimeError(f"expected comma-separated {convert.__name__} values, got {text!r}") from None


def settings_from_command_line(settings_type: type, given: dict[str, Any]) -> Any:
    """The settings whose command-line options were given as `given` (each field's option value by its name): a
    choice's name becomes its value, a comma-separated text its values."""
    kinds = typing.get_type_hints(settings_type)
    values = {}
    for field in command_line_fields(settings_type):
        value, choices = given[field.name], field.metadata["choices"]
        if isinstance(choices, Mapping):
            if value not in choices:
                raise KVRuntimeError(f"{flag_of(field)} {value!r}: use one of {', '.join(choices)}")
            value = choices[value]
        elif typing.get_origin(kinds[field.name]) is tuple:
            value = comma_separated(value, typing.get_args(kinds[field.name])[0])
        values[field.name] = value
    return settings_type(**values)


def command_line_arguments(settings: Any) -> list[str]:
    """The options that give `settings` on a command line (`settings_from_command_line`'s inverse): each field
    whose value is not its default, as its flag and the value as the option reads it."""
    kinds = typing.get_type_hints(type(settings))
    arguments = []
    for field in command_line_fields(type(settings)):
        value = getattr(settings, field.name)
        if value == field.default:
            continue
        choices = field.metadata["choices"]
        if isinstance(choices, Mapping):
            arguments += [flag_of(field), next(name for name, choice in choices.items() if choice == value)]
        elif typing.get_origin(kinds[field.name]) is tuple:
            arguments += [flag_of(field), ",".join(str(item) for item in value)]
        elif isinstance(value, bool):  # typer's pair of flags: --x / --no-x
            arguments.append(flag_of(field) if value else "--no-" + field.name.replace("_", "-"))
        else:
            arguments += [flag_of(field), str(value)]
    return arguments


class Settings:
    """A recipe's settings: `check` refuses a value outside its field's choices (a mapping's names are the command
    line's shorthands: in Python the field takes any value of its type), then the recipe's own rules."""

    def check(self) -> None:
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            choices, value = field.metadata.get("choices"), getattr(self, field.name)
            if isinstance(choices, tuple) and value not in choices:
                raise KVRuntimeError(f"{flag_of(field)} {value!r}: use one of {', '.join(choices)}")
        self.check_values()

    def check_values(self) -> None:
        """The recipe's own rules on its values (none by default)."""
