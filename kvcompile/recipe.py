"""What every compile command is: a recipe, run the same way.

A recipe compiles one artifact kind. It is made with the command's inputs (which corpus, which artifacts), takes a
settings dataclass (the knobs, checked by `check` before anything is loaded), says how many positions a work item
takes (`positions`), prepares what it reads besides the model (`prepare`), all before torch is imported: bad input
is refused in a fraction of a second, not after loading. Then it `run`s over its work items (probes, prompts,
rollouts) on the model, with checkpoints and shares where it has them.
`finish` turns complete partial statistics into the artifact (what `kvcompile merge` calls), `plot` draws it beside
the file, and `describe` says in a few lines what was learned. `compile_artifact` is the one skeleton every command
goes through: check, claim the output, prepare, load the model, run, write, plot, describe.

A new recipe is one package under `kvcompile/recipes/`: a torch-free `settings.py` whose settings dataclass declares
the command's options (`kvcompile.settings.option`: help and choices beside each field), a torch-free `recipe.py`
with its `Recipe` subclass (importing the work inside `run`, `finish`, `plot`), registered in
`kvcompile/recipes/__init__.py`, and a short command in `cli/commands.py` (`compile_command`) that makes the recipe from
its inputs; the command line is derived from the settings. Every artifact a command writes ends in
.safetensors, and only an artifact of the kind it writes is ever replaced (`claim_artifact`).
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from kvcompile.calibration.shards import PARTIAL_KIND
from kvruntime import KVRuntimeError
from kvruntime.artifacts.artifact_header import ARTIFACT_SUFFIX, artifact_file_name
from kvruntime.errors import short_repr
from kvruntime.models.default_model import SHIPPED_MODELS

if TYPE_CHECKING:  # the compile stage's heavy modules load when a recipe runs, not when the command line starts
    from kvcompile.calibration.job import CompileJob
    from kvruntime.artifacts.fingerprint import ModelFingerprint

RUN_RECORD_MARK = "run_of"  # the key that tells a run record (`run_record_path`) from another JSON file
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DEVICE_KINDS = ("cpu", "cuda", "mps")
# A compile command's options that say where and how it writes, not what it computes: left out of the command an
# artifact records, and never taken from a recorded command (`kvcompile reproduce`).
OUTPUT_OPTIONS = ("out", "resume", "shard", "checkpoint_every")
DTYPES = ("float32", "bfloat16", "float16")


def artifact_folder(model: str) -> Path:
    """A shipped model's shipped artifacts (artifacts/<its folder>/), else the model's folder in the store."""
    from kvcompile.shipped import shipped_folder

    shipped = SHIPPED_MODELS.get(model)
    return shipped_folder("artifacts") / shipped.artifacts if shipped else store_folder(model)


def model_identity(model: str) -> ModelFingerprint | None:
    """The model's fingerprint before it loads, whichever way it is given: a shipped model's from its shipped
    artifacts (no torch), else from its weights' files (a GGUF through its converted cache, converted first where
    it is not there); None where they cannot be read before loading (the model then keys its folders by path)."""
    try:
        stamp = os.stat(model).st_mtime_ns  # a folder saved again is another model
    except OSError:
        stamp = None
    return _identity(model, stamp)


@functools.lru_cache(maxsize=32)
def _identity(model: str, stamp: int | None) -> ModelFingerprint | None:
    shipped = SHIPPED_MODELS.get(model)
    if shipped is not None:
        from kvcompile.shipped import shipped_folder

        known = folder_identity(shipped_folder("artifacts") / shipped.artifacts)
        if known is not None:
            return known
    from kvruntime.artifacts.fingerprint import folder_fingerprint
    from kvruntime.models.model_loading import weights_folder

    folder = weights_folder(model)
    return folder_fingerprint(folder) if folder is not None else None


def refuse_other_models_artifacts(model: str, paths: Iterable[Path], force: bool = False) -> None:
    """Refuse an artifact compiled for other weights than the model's, from its header's fingerprint against the
    model's, both read before the model loads (`model_identity`), torch-free (with `force`, the warning is left to
    where it is applied); a model whose weights cannot be read before loading is checked when they are applied, and
    so is a file whose header does not say."""
    from kvruntime.artifacts.fingerprint import check_compiled_for

    identity = model_identity(model)
    for path in paths if identity is not None else ():
        said = compiled_for(path)
        if said is not None:
            check_compiled_for(*said, str(path), identity, force, warn=False)


def folder_identity(folder: Path) -> ModelFingerprint | None:
    """The model a folder of artifacts was compiled for, from the header of its first artifact that says (no
    torch); None for a folder without one."""
    for path in sorted(folder.glob(f"*{ARTIFACT_SUFFIX}")):
        said = compiled_for(path)
        if said is not None:
            return said[0]
    return None


def compiled_for(path: Path) -> tuple[ModelFingerprint, str] | None:
    """The model a kvcompile artifact was compiled for and its kind, from its header alone (no torch); None for a
    file that is not one, or whose header names no model or an unknown kind (reading it whole refuses it)."""
    from kvruntime import ARTIFACT_KINDS
    from kvruntime.artifacts.artifact_header import load_json, read_header
    from kvruntime.artifacts.fingerprint import ModelFingerprint

    try:
        header = read_header(path)
        model, kind = ModelFingerprint.from_dict(load_json(header["model"])), header["kind"]
        known = kind in ARTIFACT_KINDS
    except (KVRuntimeError, KeyError, TypeError, ValueError, RecursionError):
        return None
    return (model, kind) if known else None


def store_folder(model: str) -> Path:
    """Where the compile commands write a model's artifacts by default: the store under kvcompile's cache
    ($KVCOMPILE_CACHE/artifacts/), a folder per set of weights, named by their fingerprint, so that a model given by
    name, as a GGUF file (renamed or not) or as a saved folder writes and finds one folder. A model whose weights
    cannot be read before it loads gets a folder by its name and place. The shipped folders are never written."""
    import hashlib

    from kvruntime.files import cache_root

    identity = model_identity(model)
    if identity is not None:
        return cache_root() / "artifacts" / f"{identity.architecture}-{identity.weights_hash}"
    where = hashlib.sha256(str(Path(model).expanduser().absolute()).encode()).hexdigest()[:12]
    return cache_root() / "artifacts" / f"{Path(model).name or 'model'}-{where}"


def artifact_folders(model: str) -> tuple[Path, ...]:
    """Where a model's artifacts are read, in order: its store folder (what was compiled here), then every shipped
    folder compiled for the same weights (by the fingerprint in its artifacts' headers), or, where the weights cannot
    be read before loading, a shipped model's own."""
    from kvcompile.shipped import shipped_folder

    identity = model_identity(model)
    if identity is None:
        return tuple(dict.fromkeys((store_folder(model), artifact_folder(model))))
    try:
        shipped = sorted(folder for folder in shipped_folder("artifacts").iterdir() if folder.is_dir())
    except KVRuntimeError:
        shipped = []  # none shipped
    return (store_folder(model), *(folder for folder in shipped if folder_identity(folder) == identity))


def default_artifact(model: str, kind: str) -> Path:
    """The model's artifact of `kind`: the first of `artifact_folders` that holds one, else where it is compiled."""
    name = artifact_file_name(kind)
    return next(
        (folder / name for folder in artifact_folders(model) if (folder / name).exists()),
        compiled_artifact(model, kind),
    )


def compiled_artifact(model: str, kind: str) -> Path:
    """Where a compile command writes the model's artifact of `kind` without --out."""
    return store_folder(model) / artifact_file_name(kind)


def check_not_shipped(path: Path, option: str) -> None:
    """Refuse an output inside a shipped artifacts folder (the checkout's or an installed package's): they are read
    only, whatever command or --out names them."""
    from kvcompile.shipped import shipped_folder

    try:
        shipped = shipped_folder("artifacts").resolve()
    except KVRuntimeError:
        return  # none shipped: nothing to protect
    resolved = Path(os.path.realpath(path))
    if resolved == shipped or shipped in resolved.parents:
        raise KVRuntimeError(
            f"{option} {short_repr(str(path))} is inside the shipped artifacts ({shipped}), which no command writes: "
            "leave --out out (compiled artifacts go to the store under $KVCOMPILE_CACHE) or give another folder"
        )


class Recipe(abc.ABC):
    """One compile command. Subclasses set `kind` and implement `run` and `plot`."""

    kind: ClassVar[str]  # the artifact kind written (`kvruntime.ARTIFACT_KINDS[kind].command` names the command)
    # Whether the work items can be split into shares (--shard i/n, torchrun ranks) whose partial statistics
    # `kvcompile merge` adds up; such a recipe implements `finish`.
    shardable: ClassVar[bool] = False
    devices: ClassVar[tuple[str, ...]] = DEVICE_KINDS  # where its model may run (the sums stay on the CPU)

    def check(self, settings: Any) -> None:
        """Refuse bad settings before anything is loaded (default: `settings.check()`)."""
        settings.check()

    def prepare(self, settings: Any) -> Any:
        """Load and check what the recipe reads besides the model (corpus, task set, artifacts), before the model
        is loaded. Returns what `run` gets as `inputs` (default: nothing)."""
        return None

    def positions(self, settings: Any) -> tuple[int, str] | None:
        """The most positions a work item takes in the model, and the options that make it so (None: not known
        before the model loads). Refused when the model has fewer, before and after it loads."""
        return None

    def companions(self, out: Path) -> dict[Path, str]:
        """Artifacts written beside `out` besides the picture, with their kinds (default: none)."""
        return {}

    @abc.abstractmethod
    def run(self, job: CompileJob, settings: Any, inputs: Any) -> Any:
        """The artifact (or, for a share of a shardable run, its partial statistics)."""

    def finish(self, sums: dict, run: Any) -> Any:
        """The artifact from complete partial statistics (shardable recipes)."""
        raise KVRuntimeError(f"statistics of {self.kind!r} cannot be merged")

    @abc.abstractmethod
    def plot(self, artifact: Any, path: Path) -> str:
        """Draw the artifact into `path` (PNG); returns the line to print."""

    def describe(self, artifact: Any) -> str | None:
        """A few lines on what was compiled, printed after the artifact is written (default: none)."""
        return None

    def written(self, job: CompileJob, artifact: Any) -> None:
        """Called once the artifact is safely written: drop what only served the run (default: nothing)."""


class CorpusRecipe(Recipe):
    """A recipe whose work items are calibration prompts or probes from a corpus, split into shares (it implements
    `finish`). The corpus is read in `prepare`, before the model loads."""

    shardable = True

    def __init__(self, corpus: str | None = None) -> None:
        self.corpus = corpus  # --corpus (None: the shipped Austen novels)

    def prepare(self, settings: Any) -> Any:
        from kvcompile.calibration.corpus import load_corpus

        return load_corpus(self.corpus)


def check_checkpoint_every(items: int) -> None:
    if items < 1:
        raise KVRuntimeError(f"--checkpoint-every {items}: give a number of items of at least 1")


def claim_output(
    resources: contextlib.ExitStack, path: Path, folder: bool = False, lock: bool = True, option: str = "--out"
) -> Path:
    """Check, before any work, that `path` can be written (a file, or with `folder` a folder), and hold its lock
    for the rest of the command, so that two runs never write the same output at once."""
    from kvruntime.files import check_output_file, check_output_folder, path_lock

    check_not_shipped(path, option)
    (check_output_folder if folder else check_output_file)(path, option)
    if lock:
        resources.enter_context(path_lock(path, wait=False))
    return path


def picture_path(artifact: Path) -> Path:
    """Where an artifact's picture is drawn: beside it, `<stem>.png`."""
    return artifact.with_suffix(".png")


def run_record_path(artifact: Path) -> Path:
    """Where the circumstances of an artifact's compile (date, wall time, machine) are written: beside it,
    `<stem>.run.json`. They stay out of the artifact, so that the same command gives the same bytes."""
    return artifact.with_suffix(".run.json")


def read_run_record(artifact: Path) -> dict[str, Any]:
    """The run record beside an artifact (`run_record_path`), or {} when there is none or it is not one."""
    try:
        record = json.loads(run_record_path(artifact).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) and RUN_RECORD_MARK in record else {}


def claim_artifact(
    resources: contextlib.ExitStack, path: Path, kinds: set[str], lock: bool = True, option: str = "--out"
) -> Path:
    """`claim_output` for an artifact and its picture: the name ends in .safetensors (so the picture never takes
    its place), and what is already there is replaced only when it is an artifact of one of `kinds` (a picture: a
    PNG). A command never writes over a file it did not make."""
    from kvruntime.artifacts.artifact_header import header_kind

    claim_output(resources, path, lock=lock, option=option)  # a folder, or a folder nothing can be written in
    if path.suffix != ARTIFACT_SUFFIX:
        raise KVRuntimeError(
            f"{option} {path}: an artifact's name ends in {ARTIFACT_SUFFIX} (its picture is drawn beside it as .png)"
        )
    if path.is_file() and header_kind(path) not in kinds:
        raise KVRuntimeError(
            f"{option} {path} exists and is not a {' or '.join(sorted(kinds))} artifact: kvcompile replaces only "
            "its own artifacts; give another name or move the file"
        )
    picture = picture_path(path)
    if picture.exists() and not (picture.is_file() and _starts_with(picture, PNG_SIGNATURE)):
        raise KVRuntimeError(
            f"{option} {path}: its picture's name {picture} is taken by a file that is not a PNG; move that file"
        )
    record = run_record_path(path)
    if record.exists() and not read_run_record(path):
        raise KVRuntimeError(
            f"{option} {path}: its run record's name {record} is taken by a file that is not one; move that file"
        )
    return path


def _starts_with(path: Path, prefix: bytes) -> bool:
    with open(path, "rb") as handle:
        return handle.read(len(prefix)) == prefix


def compile_target(out: Path | None, model: str, kind: str, shard: Any) -> Path:
    """--out, else the model's default artifact; a separate job's partial statistics get a name of their own."""
    if out is not None:
        return out
    if shard.in_process_group or shard.is_whole:
        return compiled_artifact(model, kind)
    return compiled_artifact(model, f"{kind}.shard{shard.index}of{shard.count}")


def check_device_name(text: str, supported: tuple[str, ...] = DEVICE_KINDS) -> None:
    """Refuse a --device that is no device name, a kind the command does not run on, or one this machine plainly
    lacks (torch-free: `resolve_device` asks torch for the rest once it is imported)."""
    kind, _, index = text.partition(":")
    if kind not in DEVICE_KINDS or (index and not index.isdigit()) or (index and kind != "cuda"):
        raise KVRuntimeError(f"--device {short_repr(text)}: use cpu, cuda, cuda:N or mps")
    if kind not in supported:
        raise KVRuntimeError(f"--device {text!r}: this command runs on {', '.join(supported)} only")
    if not device_kind_possible(kind):
        raise KVRuntimeError(f"--device {text!r}: this machine has no {'CUDA' if kind == 'cuda' else 'MPS'} device")


def device_kind_possible(kind: str, system: str | None = None, root: Path = Path("/")) -> bool:
    """Whether this machine may have a device of `kind`, read from the system alone: MPS on macOS only; CUDA on Linux
    only where an NVIDIA driver (/proc/driver/nvidia, /dev/nvidiactl) or ROCm's (/dev/kfd) is there. Elsewhere (a
    Windows machine) it may: torch says."""
    system = system or platform.system()
    if kind == "mps":
        return system == "Darwin"
    if kind == "cuda" and system == "Linux":
        return any((root / where).exists() for where in ("proc/driver/nvidia", "dev/nvidiactl", "dev/kfd"))
    return True


def resolve_device(text: str, supported: tuple[str, ...] = DEVICE_KINDS) -> str:
    """--device as torch names it; `cuda` under torchrun is this rank's GPU (`cuda:LOCAL_RANK`). A device this
    machine lacks, or the command does not support, is refused."""
    import os

    import torch

    check_device_name(text, supported)
    kind, _, index = text.partition(":")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise KVRuntimeError(f"--device {text!r}: this machine has no CUDA device")
        if not index and "LOCAL_RANK" in os.environ:  # torchrun: one GPU per rank
            text = f"cuda:{os.environ['LOCAL_RANK']}"
        if int(text.partition(":")[2] or 0) >= torch.cuda.device_count():
            raise KVRuntimeError(f"--device {text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise KVRuntimeError(f"--device {text!r}: this machine has no MPS device")
    return text


def check_dtype_name(text: str) -> None:
    if text not in DTYPES:
        raise KVRuntimeError(f"--dtype {text!r}: use one of {', '.join(DTYPES)}")


def resolve_dtype(text: str) -> Any:
    """--dtype as a torch dtype (float32, bfloat16, float16): the model's weights and activations."""
    import torch

    check_dtype_name(text)
    return getattr(torch, text)


def load_model(model: str, device: str = "cpu", dtype: str = "float32") -> tuple:
    """The model and tokenizer (`kvruntime.load_model`) on `device` in `dtype`, without transformers' progress bars."""
    import transformers

    import kvruntime

    transformers.utils.logging.disable_progress_bar()
    loaded, tokenizer = kvruntime.load_model(model, dtype=resolve_dtype(dtype))
    return loaded.to(device), tokenizer


def compile_artifact(
    recipe: Recipe,
    settings: Any,
    model: str,
    out: Path | None,
    resources: contextlib.ExitStack,
    resume: bool = False,
    checkpoint_every: int = 4,
    shard: str | None = None,
    echo: Any = print,
    device: str = "cpu",
    dtype: str = "float32",
    command: str | None = None,
) -> Any:
    """Run a compile command end to end: refuse bad input before torch loads (settings, model, device, shard,
    positions, outputs, inputs), run the recipe on the model, then write the artifact (`write_result`).
    `command` is the command line that reruns it (every setting spelled out, the output left out), recorded in the
    artifact's provenance."""
    from kvcompile.calibration.shards import Shard, planned_shard
    from kvruntime.models.model_spec import check_model_spec, check_positions, loaded_position_limit, position_limit

    started = time.perf_counter()
    recipe.check(settings)
    check_model_spec(model)
    check_device_name(device, recipe.devices)
    check_dtype_name(dtype)
    check_checkpoint_every(checkpoint_every)
    if shard is not None and not recipe.shardable:
        raise KVRuntimeError(f"{recipe.kind} is compiled in one run: --shard does not apply")
    planned = planned_shard(shard) if recipe.shardable else Shard()
    positions = recipe.positions(settings)
    if positions is not None:
        check_positions(positions[0], position_limit(model), positions[1])
    kinds = {recipe.kind, PARTIAL_KIND} if recipe.shardable else {recipe.kind}
    target = claim_artifact(resources, compile_target(out, model, recipe.kind, planned), kinds, planned.writes_results)
    for companion, kind in recipe.companions(target).items():
        claim_artifact(resources, companion, {kind}, planned.writes_results, option=f"the {kind} beside --out:")
    inputs = recipe.prepare(settings)

    from kvcompile.calibration.distributed import parse_shard
    from kvcompile.calibration.job import CompileJob

    device = resolve_device(device, recipe.devices)
    share = parse_shard(shard) if recipe.shardable else Shard()
    loaded, tokenizer = load_model(model, device=device, dtype=dtype)
    if positions is not None:
        check_positions(positions[0], loaded_position_limit(loaded.config), positions[1])
    job = CompileJob(loaded, tokenizer, target, resume, checkpoint_every, share)
    artifact = recipe.run(job, settings, inputs)
    if command is not None:
        artifact.provenance["command"] = command
        if share.writes_results:  # the companions the run wrote (CompilerKV's experience) came from it too
            for companion in recipe.companions(target):
                record_command(companion, command)
    write_result(recipe, artifact, target, started, share, echo, {"device": str(device), "dtype": dtype})
    if share.writes_results:
        recipe.written(job, artifact)
    return artifact


def record_command(path: Path, command: str) -> None:
    """Record `command` in the provenance of the artifact at `path`, written by that command's run."""
    from kvruntime import read_artifact, save_artifact

    artifact = read_artifact(path)
    artifact.provenance["command"] = command
    save_artifact(artifact, path)


def write_result(
    recipe: Recipe | None,
    artifact: Any,
    out: Path,
    started: float,
    shard: Any,
    echo: Any,
    circumstances: dict[str, Any] | None = None,
) -> None:
    """Save the artifact and its run record (`run_record_path`: the date, the command's wall time since `started`,
    a resumed run counting its last part only, the machine and `circumstances`), then drop the run's checkpoints
    (only once the artifact is safely written), then draw its picture beside it and describe it. In a process group
    rank 0 writes; partial statistics of a separate job get no picture."""
    from kvcompile.calibration.checkpoint import discard_checkpoint
    from kvcompile.calibration.distributed import wait_for_all
    from kvruntime import save_artifact
    from kvruntime.files import write_atomically

    if shard.writes_results:
        save_artifact(artifact, out)
        record = {
            RUN_RECORD_MARK: out.name,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "compile_seconds": round(time.perf_counter() - started, 1),
            "command_line": " ".join(["kvcompile", *sys.argv[1:]]),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
            "python": platform.python_version(),
            **(circumstances or {}),
        }
        text = json.dumps(record, indent=2, sort_keys=True) + "\n"
        write_atomically(run_record_path(out), lambda tmp_name: Path(tmp_name).write_text(text))
    wait_for_all(shard)
    discard_checkpoint(out, shard)
    if not shard.writes_results:
        return
    echo(f"wrote {out}")
    if artifact.kind == PARTIAL_KIND:
        done, total = int(artifact.tensors["items_done"].sum()), artifact.params["items"]
        echo(f"partial statistics ({done} of {total} items): add the other shards with `kvcompile merge`")
        return
    echo(recipe.plot(artifact, picture_path(out)))
    description = recipe.describe(artifact)
    if description:
        echo(description)
