"""What `kvcompile eval` compares: kvcompile's runtime methods, the presses of the peer library kvpress (with the
`bench` extra), and the full cache every answer is measured against.

`--methods` takes comma-separated entries: `full`; a runtime method name (`compresskv`, `kvcompose`, `snapkv`,
`kvcompress+error-aware`, ...) with optional `:key=value` method options (`kvcompose:mode=dynamic`), and
`:prefill_chunk_size=N` to stream the context in chunks of N tokens (`distilled:allocation=uniform:prefill_chunk_size=512`),
`:artifacts=DIR` to take its artifacts from another folder than `--artifacts` (two compiles side by side), and
`:kv_bits=8` or `4` to quantize the kept entries for decoding (`distilled:kv_bits=4`, compressed and quantized;
`full:kv_bits=4`, quantized alone, runs at ratio 0);
`kvpress-<press>` for one press of kvpress (`kvpress-snapkv`, `kvpress-tova`, ...) or `kvpress` for all of them
(but `kvpress-kvzap`, `kvpress-distilled` and `kvpress-srh`, which need a checkpoint or an artifact: the last two are
kvcompile's compiled scores as kvpress presses)."""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from kvruntime import ARTIFACT_KINDS, KVRuntimeError, Request
from kvruntime.artifacts.bundle import locate
from kvruntime.plumbing.quantized_cache import check_kv_bits
from kvruntime.registry import COMPARED_NAMES, method_spec
from kvruntime.requests.request import check_method_options, parse_option_pairs, required_artifact_kinds, typed_value

if TYPE_CHECKING:
    from kvruntime.methods.resolved import ResolvedRequest

FULL = "full"
# kvpress presses compared, by the name after `kvpress-`: (class name, constructor settings besides the ratio).
PRESSES: dict[str, tuple[str, dict]] = {
    "snapkv": ("SnapKVPress", {}),
    "tova": ("TOVAPress", {}),
    "expected_attention": ("ExpectedAttentionPress", {}),
    "streaming_llm": ("StreamingLLMPress", {}),
    "pyramidkv": ("PyramidKVPress", {}),
    "kvcompose": ("KVComposePress", {}),
    "compactor": ("CompactorPress", {}),
    "keydiff": ("KeyDiffPress", {}),
    "kvzip": ("KVzipPress", {}),  # context reconstruction, two extra passes (FastKVzip needs gates from the hub)
    # KVzap's linear scorer, its checkpoint compiled here (`kvcompile distill --oracle kvzip_plus --student hidden`,
    # then `kvcompile export-kvzap`): not in `kvpress` (all), since it needs that checkpoint.
    "kvzap": ("KVzapPress", {"model_type": "linear"}),
    # kvcompile's compiled scores as kvpress presses (kvruntime.integrations.kvpress), each built from the artifact
    # its runtime method of the same name applies; not in `kvpress` (all) either.
    "distilled": ("DistilledPress", {}),
    "srh": ("SRHPress", {}),
}
CHECKPOINTS = {"kvzap": "kvzap_linear"}  # presses that load a checkpoint: its folder in the artifacts folder
COMPILED_PRESSES = ("distilled", "srh")  # presses built from a kvcompile artifact, named as their runtime method
CHUNK_OPTION = "prefill_chunk_size"  # not a method option: how the engine feeds the context
ARTIFACTS_OPTION = "artifacts"  # not a method option: the folder its artifacts come from
KV_BITS_OPTION = "kv_bits"  # not a method option: the kept entries quantized to this many bits (kvruntime)


class Contestant(abc.ABC):
    """One thing `eval` compares with the full cache: its label in the records, the files it needs (found before
    torch loads) and its prefill of a context, ready to answer."""

    label: str
    kv_bits: int | None  # the kept entries quantized for decoding (answers one prompt at a time)
    compresses: ClassVar[bool] = True  # removes entries (the full cache does not: quantized, it runs at ratio 0)

    @property
    def batches(self) -> bool:
        """Whether prompts that share its run answer together, as one batch."""
        return False

    def files(self, folders: tuple[Path, ...]) -> list[Path]:
        """The artifacts or checkpoint it reads, from the first of `folders` holding each (the eval's `--artifacts`,
        else the model's compiled then shipped ones); a missing one is refused with the command that makes it."""
        return []

    def resolved(self, files: list[Path], requests: list[Request]) -> Contestant:
        """Itself, its requests resolved once for the run: refused, from its files' headers, where it cannot serve
        one (before torch loads)."""
        return self

    @abc.abstractmethod
    def prefilled(
        self, model: Any, ratio: float, context_ids: Any, files: list[Path], shared: Any = None
    ) -> contextlib.AbstractContextManager:
        """Prefill and compress `context_ids` at `ratio` (cut from the `shared` prefill where it can), timed; the
        block yields a `prefill.AnswerableContext` to answer from."""


@dataclasses.dataclass(frozen=True)
class FullCache(Contestant):
    label: str = FULL
    kv_bits: int | None = None
    compresses: ClassVar[bool] = False

    def prefilled(
        self, model: Any, ratio: float, context_ids: Any, files: list[Path], shared: Any = None
    ) -> contextlib.AbstractContextManager:
        from kvcompile.evaluation.prefill import cache_prefilled

        return cache_prefilled(model, None, self.kv_bits, context_ids, shared)


@dataclasses.dataclass(frozen=True)
class RuntimeMethod(Contestant):
    """A kvruntime method with its options, as `--methods` names it."""

    label: str
    method: str  # its registered name
    options: Mapping[str, object] = dataclasses.field(default_factory=dict)
    prefill_chunk_size: int | None = None  # stream the context in chunks of this many tokens
    artifacts: Path | None = None  # its artifacts' folder, when not --artifacts
    kv_bits: int | None = None
    # Its method, options, artifacts and the run's ratios, resolved once per run (`resolved`).
    request: ResolvedRequest | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def batches(self) -> bool:
        return self.kv_bits is None  # a quantized cache is made one prompt at a time (kvruntime's kv_bits)

    def files(self, folders: tuple[Path, ...]) -> list[Path]:
        own = (self.artifacts,) if self.artifacts else folders
        return [_artifact_file(self.label, own, kind) for kind in self.artifact_kinds()]

    def artifact_kinds(self) -> list[str]:
        return required_artifact_kinds(self.method, self.options)

    def resolved(self, files: list[Path], requests: list[Request]) -> RuntimeMethod:
        from kvruntime.methods.resolved import resolve_request
        from kvruntime.requests.serving import method_facts

        memory = method_facts(self.method, self.options).memory or "padded"
        ratios = [request.ratio for request in requests]
        resolved = resolve_request(
            self.method, ratios, None, memory, files, self.options, self.prefill_chunk_size, self.kv_bits
        )
        return dataclasses.replace(self, request=resolved)

    def prefilled(
        self, model: Any, ratio: float, context_ids: Any, files: list[Path], shared: Any = None
    ) -> contextlib.AbstractContextManager:
        from kvcompile.evaluation.prefill import compressed_prefill

        return compressed_prefill(self.compressing(model, ratio), context_ids, shared)

    def compressing(self, model: Any, ratio: float) -> contextlib.AbstractContextManager:
        """`kvruntime.compress` on its request resolved for the run, at `ratio`."""
        import kvruntime

        if self.request is None:
            raise KVRuntimeError(f"{self.label} was not resolved for the run (`resolve_contestants`)")
        return kvruntime.compress(model, self.request, ratio=ratio)


@dataclasses.dataclass(frozen=True)
class Press(Contestant):
    """A kvpress press, by its name after `kvpress-` (`PRESSES`)."""

    label: str
    press_name: str
    kv_bits: ClassVar[None] = None  # presses answer from a full-precision cache

    def files(self, folders: tuple[Path, ...]) -> list[Path]:
        if self.press_name in COMPILED_PRESSES:
            return [_artifact_file(self.label, folders, method_spec(self.press_name)[0].needs)]
        if self.press_name not in CHECKPOINTS:
            return []
        found = [folder / CHECKPOINTS[self.press_name] for folder in folders]
        checkpoint = next((path for path in found if (path / "config.json").is_file()), found[0])
        if not (checkpoint / "config.json").is_file():
            raise KVRuntimeError(
                f"{self.label} needs the checkpoint {checkpoint}: distil it with `kvcompile distill "
                f"--oracle kvzip_plus --student hidden`, then `kvcompile export-kvzap ... --out {checkpoint}`"
            )
        return [checkpoint]

    def press(self, ratio: float, model: object = None, files: list[Path] = ()) -> object:
        """The press at this compression ratio (kvpress is imported only here, when a press is run); KVzap with the
        model of `files` (its checkpoint folder) for `model`; a compiled press from its artifact (`files`: the
        artifact file)."""
        import kvpress

        class_name, settings = PRESSES[self.press_name]
        if self.press_name in COMPILED_PRESSES:
            from kvruntime.integrations import kvpress as compiled

            return getattr(compiled, class_name).from_artifact(files[0], compression_ratio=ratio)
        press = getattr(kvpress, class_name)(compression_ratio=ratio, **settings)
        if self.press_name in CHECKPOINTS:
            from kvpress.presses.kvzap_press import KVzapModel

            # kvpress loads `nvidia/KVzap-<type>-<model name>` from the hub unless that name is already loaded.
            press.kvzap_model_name = f"nvidia/KVzap-linear-{model.config.name_or_path.split('/')[-1]}"
            press.kvzap_model = KVzapModel.from_pretrained(files[0])
            press.kvzap_model.layers = at_model_layers(model, press.kvzap_model.layers)
        return press

    def prefilled(
        self, model: Any, ratio: float, context_ids: Any, files: list[Path], shared: Any = None
    ) -> contextlib.AbstractContextManager:
        from kvcompile.evaluation.prefill import cache_prefilled

        return cache_prefilled(model, self.press(ratio, model, files), None, context_ids, shared)


def at_model_layers(model: Any, modules: Any) -> Any:
    """A KVzap checkpoint's modules, one per layer the runtime cuts (as kvcompile's artifacts have them: the
    full-attention layers), placed at those layers' indices, where kvpress looks a layer's module up. A sliding-window
    layer gets a module that refuses to score: the shared prefill's replay never asks it, kvpress's own pipeline
    would (it cuts every layer)."""
    from torch import nn

    from kvruntime.models.layout import model_layout

    class NoScorer(nn.Module):
        def forward(self, hidden_states: Any) -> Any:
            raise KVRuntimeError(
                "the KVzap checkpoint has no scorer for a sliding-window layer (kvruntime leaves them)"
            )

    layout = model_layout(model)
    if len(modules) != len(layout.cut_layers):
        raise KVRuntimeError(
            f"the KVzap checkpoint has {len(modules)} layers, the model {len(layout.cut_layers)} to cut"
        )
    return nn.ModuleList(
        modules[layout.cut_position(i)] if i in layout.cut_layers else NoScorer() for i in range(len(layout.kinds))
    )


def _artifact_file(label: str, folders: tuple[Path, ...], kind: str) -> Path:
    """The artifact of `kind` in the first of `folders` holding one (a bundle's, or `<kind>.safetensors` in a plain
    folder)."""
    from kvruntime.artifacts.bundle import resolve_artifact_path

    refusals = []
    for folder in folders:
        try:
            return resolve_artifact_path(folder, kind)
        except KVRuntimeError as exc:
            refusals.append(exc)
    command = ARTIFACT_KINDS[kind].command
    raise KVRuntimeError(f"{label}: {refusals[-1]}; compile it with `{command}` or pass --artifacts DIR") from None


def kvpress_available() -> bool:
    """Whether kvpress is installed (found, not imported: importing it loads torch and transformers)."""
    return importlib.util.find_spec("kvpress") is not None


def default_methods() -> str:
    return ",".join([FULL, *COMPARED_NAMES, *(["kvpress"] if kvpress_available() else [])])


def parse_methods(text: str) -> list[Contestant]:
    """Contestants from `--methods`; the full cache always comes first (it is the reference of every score)."""
    contestants: list[Contestant] = [FullCache()]
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        if entry == FULL:
            continue
        if entry.startswith(f"{FULL}:"):  # the full cache quantized: quantization alone, at ratio 0
            contestants.append(FullCache(entry, _kv_bits(entry, entry.split(":")[1:], {})))
            continue
        if entry == "kvpress" or entry.startswith("kvpress-"):
            contestants += _presses(entry)
            continue
        name, *pairs = entry.split(":")
        method_spec(name)  # refuses an unknown method with the list of known ones
        given = parse_option_pairs(pairs, name, f"--methods {entry!r}: option")
        chunk = _whole_number(given.pop(CHUNK_OPTION, None))
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise KVRuntimeError(f"--methods {entry!r}: {CHUNK_OPTION} must be a positive number of tokens")
        folder = given.pop(ARTIFACTS_OPTION, None)
        if folder is not None and not locate(str(folder)).is_dir():
            raise KVRuntimeError(f"--methods {entry!r}: {ARTIFACTS_OPTION}={folder} is not a folder, bundle or hub id")
        bits = _kv_bits(entry, [], given)
        options = check_method_options(name, given)
        contestants.append(
            RuntimeMethod(
                entry,
                name,
                options,
                chunk,
                None if folder is None else Path(str(folder)),
                bits,
            )
        )
    labels = [c.label for c in contestants]
    if len(set(labels)) != len(labels):
        raise KVRuntimeError(f"--methods names a method twice: {text!r}")
    if len(contestants) == 1:
        raise KVRuntimeError("--methods names no method to compare with the full cache")
    return contestants


def _kv_bits(entry: str, pairs: list[str], given: dict[str, object]) -> int | None:
    """The `kv_bits` of an entry, taken out of its parsed options `given` (or parsed from `pairs`, the full cache's,
    which takes no other), checked."""
    if pairs:
        given = parse_option_pairs(pairs, None, f"--methods {entry!r}: option")
        if set(given) != {KV_BITS_OPTION}:
            raise KVRuntimeError(f"--methods {entry!r}: the full cache takes {KV_BITS_OPTION} only")
    bits = _whole_number(given.pop(KV_BITS_OPTION, None))
    check_kv_bits(bits)
    return bits


def _whole_number(text: object) -> object:
    """An entry's own option (not the method's: written as text) as an int where it is a whole number."""
    return typed_value(int, text) if isinstance(text, str) else text


def _presses(entry: str) -> list[Contestant]:
    every = [n for n in PRESSES if n not in CHECKPOINTS and n not in COMPILED_PRESSES]
    names = every if entry == "kvpress" else [entry.removeprefix("kvpress-")]
    unknown = [n for n in names if n not in PRESSES]
    if unknown:
        raise KVRuntimeError(f"unknown kvpress press {unknown[0]!r} (compared presses: {', '.join(PRESSES)})")
    if not kvpress_available():
        raise KVRuntimeError(
            f"{entry} needs kvpress: install the bench extra (`make .venv-bench/bin/.installed`, or pip install -e '.[bench]')"
        )
    return [Press(f"kvpress-{n}", n) for n in names]


def artifact_paths(contestants: list[Contestant], folders: tuple[Path, ...]) -> dict[str, list[Path]]:
    """Each contestant's files (`Contestant.files`), found before any model work."""
    return {contestant.label: contestant.files(folders) for contestant in contestants}


def resolve_contestants(
    contestants: list[Contestant], paths: dict[str, list[Path]], ratios: tuple[float, ...]
) -> list[Contestant]:
    """The contestants with their requests resolved once for the run: each refuses a ratio it cannot serve from its
    files' headers, before torch loads (the artifacts' tensors are checked when a method is built, once, and
    against the model when they are applied)."""
    requests = [Request(ratio=ratio) for ratio in ratios]
    return [contestant.resolved(paths[contestant.label], requests) for contestant in contestants]
