"""What `kvcompile eval` compares: kvcompile's runtime methods, the presses of the peer library kvpress (with the
`bench` extra), and the full cache every answer is measured against.

`--methods` takes comma-separated entries: `full`; a runtime method name (`compresskv`, `kvcompose`, `snapkv`,
`kvcompress+budgets`, ...) with optional `:key=value` method options (`kvcompose:mode=dynamic`), and
`:prefill_chunk_size=N` to stream the context in chunks of N tokens (`distilled:allocation=uniform:prefill_chunk_size=512`),
`:artifacts=DIR` to take its artifacts from another folder than `--artifacts` (two compiles side by side), and
`:kv_bits=8` or `4` to quantize the kept entries for decoding (`distilled:kv_bits=4`, compressed and quantized;
`full:kv_bits=4`, quantized alone, runs at ratio 0);
`kvpress-<press>` for one press of kvpress (`kvpress-snapkv`, `kvpress-tova`, ...) or `kvpress` for all of them
(but `kvpress-kvzap`, `kvpress-distilled` and `kvpress-srh`, which need a checkpoint or an artifact: the last two are
kvcompile's compiled scores as kvpress presses)."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from pathlib import Path

from kvruntime import ARTIFACT_KINDS, KVRuntimeError, Request
from kvruntime.bundle import locate
from kvruntime.quantized_cache import check_kv_bits
from kvruntime.registry import COMPARED_NAMES, method_spec
from kvruntime.request import check_method_options, parse_option_pairs, required_artifact_kinds

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


@dataclasses.dataclass(frozen=True)
class Contestant:
    label: str
    kind: str  # "full", "kvcompile" or "kvpress"
    method: str = ""  # runtime method name, or press name
    options: Mapping[str, object] = dataclasses.field(default_factory=dict)
    prefill_chunk_size: int | None = None  # stream the context in chunks of this many tokens
    artifacts: Path | None = None  # its artifacts' folder, when not --artifacts
    kv_bits: int | None = None  # the kept entries quantized for decoding (answers one prompt at a time)

    def artifact_kinds(self) -> list[str]:
        if self.kind == "kvpress":
            return [method_spec(self.method)[0].needs] if self.method in COMPILED_PRESSES else []
        return required_artifact_kinds(self.method, self.options) if self.kind == "kvcompile" else []

    def press(self, ratio: float, model: object = None, checkpoints: list[Path] = ()) -> object:
        """A kvpress press at this compression ratio (kvpress is imported only here, when a press is run); KVzap
        with the model of `checkpoints` (its checkpoint folder) for `model`; a compiled press from its artifact
        (`checkpoints`: the artifact file)."""
        import kvpress

        class_name, settings = PRESSES[self.method]
        if self.method in COMPILED_PRESSES:
            from kvruntime.integrations import kvpress as compiled

            return getattr(compiled, class_name).from_artifact(checkpoints[0], compression_ratio=ratio)
        press = getattr(kvpress, class_name)(compression_ratio=ratio, **settings)
        if self.method in CHECKPOINTS:
            from kvpress.presses.kvzap_press import KVzapModel

            # kvpress loads `nvidia/KVzap-<type>-<model name>` from the hub unless that name is already loaded.
            press.kvzap_model_name = f"nvidia/KVzap-linear-{model.config.name_or_path.split('/')[-1]}"
            press.kvzap_model = KVzapModel.from_pretrained(checkpoints[0])
        return press


def kvpress_available() -> bool:
    """Whether kvpress is installed (found, not imported: importing it loads torch and transformers)."""
    return importlib.util.find_spec("kvpress") is not None


def default_methods() -> str:
    return ",".join([FULL, *COMPARED_NAMES, *(["kvpress"] if kvpress_available() else [])])


def parse_methods(text: str) -> list[Contestant]:
    """Contestants from `--methods`; the full cache always comes first (it is the reference of every score)."""
    contestants = [Contestant(FULL, "full")]
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        if entry == FULL:
            continue
        if entry.startswith(f"{FULL}:"):  # the full cache quantized: quantization alone, at ratio 0
            contestants.append(Contestant(entry, "full", kv_bits=_kv_bits(entry, entry.split(":")[1:], {})))
            continue
        if entry == "kvpress" or entry.startswith("kvpress-"):
            contestants += _presses(entry)
            continue
        name, *pairs = entry.split(":")
        method_spec(name)  # refuses an unknown method with the list of known ones
        given = parse_option_pairs(pairs, f"--methods {entry!r}: option")
        chunk = given.pop(CHUNK_OPTION, None)
        if chunk is not None and (not isinstance(chunk, float) or not chunk.is_integer() or chunk < 1):
            raise KVRuntimeError(f"--methods {entry!r}: {CHUNK_OPTION} must be a positive number of tokens")
        folder = given.pop(ARTIFACTS_OPTION, None)
        if folder is not None and not locate(str(folder)).is_dir():
            raise KVRuntimeError(f"--methods {entry!r}: {ARTIFACTS_OPTION}={folder} is not a folder, bundle or hub id")
        bits = _kv_bits(entry, [], given)
        options = check_method_options(name, given)
        contestants.append(
            Contestant(
                entry,
                "kvcompile",
                name,
                options,
                None if chunk is None else int(chunk),
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
        given = parse_option_pairs(pairs, f"--methods {entry!r}: option")
        if set(given) != {KV_BITS_OPTION}:
            raise KVRuntimeError(f"--methods {entry!r}: the full cache takes {KV_BITS_OPTION} only")
    bits = given.pop(KV_BITS_OPTION, None)
    bits = int(bits) if isinstance(bits, float) and bits.is_integer() else bits
    check_kv_bits(bits)
    return bits


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
    return [Contestant(f"kvpress-{n}", "kvpress", n) for n in names]


def artifact_paths(contestants: list[Contestant], folder: Path) -> dict[str, list[Path]]:
    """Each kvcompile contestant's artifacts in `folder` (or its own `artifacts=` folder): a bundle's artifact of
    each kind, or `<kind>.safetensors` in a plain folder; a missing one is refused with the command that compiles
    it, before any model work."""
    from kvruntime.bundle import resolve_artifact_path

    paths = {}
    for contestant in contestants:
        own = contestant.artifacts or folder
        paths[contestant.label] = []
        for kind in contestant.artifact_kinds():
            try:
                paths[contestant.label].append(resolve_artifact_path(own, kind))
            except KVRuntimeError as exc:
                command = ARTIFACT_KINDS[kind].command
                raise KVRuntimeError(
                    f"{contestant.label}: {exc}; compile it with `{command}` or pass --artifacts DIR"
                ) from None
        if contestant.kind == "kvpress" and contestant.method in CHECKPOINTS:
            checkpoint = folder / CHECKPOINTS[contestant.method]
            if not (checkpoint / "config.json").is_file():
                raise KVRuntimeError(
                    f"{contestant.label} needs the checkpoint {checkpoint}: distil it with `kvcompile distill "
                    f"--oracle kvzip_plus --student hidden`, then `kvcompile export-kvzap ... --out {checkpoint}`"
                )
            paths[contestant.label] = [checkpoint]
    return paths


def check_contestants(contestants: list[Contestant], paths: dict[str, list[Path]], ratios: tuple[float, ...]) -> None:
    """Let each kvcompile method refuse a ratio it cannot serve from its artifacts' headers, before torch loads (the
    artifacts' tensors are checked when the methods are built, and against the model when they are applied)."""
    from kvruntime.serving import check_serves

    requests = [Request(ratio=ratio) for ratio in ratios]
    for contestant in contestants:
        if contestant.kind == "kvcompile":
            check_serves(
                contestant.method, paths[contestant.label], contestant.options, requests, contestant.prefill_chunk_size
            )
