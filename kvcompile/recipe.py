"""What every compile command is: a recipe, run the same way.

A recipe compiles one artifact kind. It is made with the command's inputs (which corpus, which artifacts), takes a
settings dataclass (the knobs, checked by `check` before anything is loaded), prepares what it reads besides the
model (`prepare`, also before the model: bad input is refused in a second, not after loading), then
`run`s over its work items (probes, prompts, rollouts) on the model, with checkpoints and shares where it has them.
`finish` turns complete partial statistics into the artifact (what `kvcompile merge` calls), `plot` draws it beside
the file, and `describe` says in a few lines what was learned. `compile_artifact` is the one skeleton every command
goes through: check, claim the output, prepare, load the model, run, write, plot, describe.

A new recipe is one package under `kvcompile/recipes/` with a `Recipe` subclass, registered in
`kvcompile/recipes/__init__.py`, and a command in `cli.py` that turns its options into settings.
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from kvruntime import KVRuntimeError

if TYPE_CHECKING:  # the compile stage's heavy modules load when a recipe runs, not when the command line starts
    from kvcompile.calibration.job import CompileJob

DEFAULT_ARTIFACT_FOLDER = "smollm2-135m-instruct"  # the default model's folder under artifacts/
DEVICE_KINDS = ("cpu", "cuda", "mps")
DTYPES = ("float32", "bfloat16", "float16")


def artifact_folder(model: str) -> Path:
    """Where a model's compiled artifacts live by default: artifacts/<model folder name>/."""
    from kvcompile.shipped import shipped_folder

    return shipped_folder("artifacts") / (DEFAULT_ARTIFACT_FOLDER if model == "default" else Path(model).name)


def default_artifact(model: str, kind: str) -> Path:
    return artifact_folder(model) / f"{kind}.safetensors"


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

    def check_model(self, settings: Any, model: Any) -> None:
        """Refuse settings the loaded model cannot serve, before any work (default: none)."""

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
    """A recipe whose work items are calibration prompts or probes from a corpus, split into shares: it names its
    compile function `(job, corpus, settings)`, its finisher `(sums, run)` and its picture `(artifact, path)`."""

    shardable = True
    compile: ClassVar[Callable[..., Any]]
    finisher: ClassVar[Callable[..., Any]]
    plotter: ClassVar[Callable[..., str]]

    def __init__(self, corpus: str | None = None) -> None:
        self.corpus = corpus  # --corpus (None: the shipped Austen novels)

    def prepare(self, settings: Any) -> Any:
        from kvcompile.calibration.corpus import load_corpus

        return load_corpus(self.corpus)

    def run(self, job: CompileJob, settings: Any, corpus: Any) -> Any:
        return self.compile(job, corpus, settings)

    def finish(self, sums: dict, run: Any) -> Any:
        return self.finisher(sums, run)

    def plot(self, artifact: Any, path: Path) -> str:
        return self.plotter(artifact, path)


def check_checkpoint_every(items: int) -> None:
    if items < 1:
        raise KVRuntimeError(f"--checkpoint-every {items}: give a number of items of at least 1")


def claim_output(resources: contextlib.ExitStack, path: Path, folder: bool = False, lock: bool = True) -> Path:
    """Check, before any work, that `path` can be written (a file, or with `folder` a folder), and hold its lock
    for the rest of the command, so that two runs never write the same output at once."""
    from kvruntime import check_output_file, check_output_folder, path_lock

    (check_output_folder if folder else check_output_file)(path)
    if lock:
        resources.enter_context(path_lock(path, wait=False))
    return path


def compile_target(out: Path | None, model: str, kind: str, shard: Any) -> Path:
    """--out, else the model's default artifact; a separate job's partial statistics get a name of their own."""
    if out is not None:
        return out
    if shard.in_process_group or shard.is_whole:
        return default_artifact(model, kind)
    return default_artifact(model, f"{kind}.shard{shard.index}of{shard.count}")


def resolve_device(text: str, supported: tuple[str, ...] = DEVICE_KINDS) -> str:
    """--device as torch names it; `cuda` under torchrun is this rank's GPU (`cuda:LOCAL_RANK`). A device this
    machine lacks, or the command does not support, is refused."""
    import os

    import torch

    kind, _, index = text.partition(":")
    if kind not in DEVICE_KINDS or (index and not index.isdigit()) or (index and kind != "cuda"):
        raise KVRuntimeError(f"--device {text!r}: use cpu, cuda, cuda:N or mps")
    if kind not in supported:
        raise KVRuntimeError(f"--device {text!r}: this command runs on {', '.join(supported)} only")
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


def resolve_dtype(text: str) -> Any:
    """--dtype as a torch dtype (float32, bfloat16, float16): the model's weights and activations."""
    import torch

    if text not in DTYPES:
        raise KVRuntimeError(f"--dtype {text!r}: use one of {', '.join(DTYPES)}")
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
) -> Any:
    """Run a compile command end to end: refuse bad input before the model loads, claim the output, run the recipe
    on the model, then write the artifact (`write_result`)."""
    from kvcompile.calibration.distributed import Shard, parse_shard
    from kvcompile.calibration.job import CompileJob

    started = time.perf_counter()
    recipe.check(settings)
    device = resolve_device(device, recipe.devices)
    resolve_dtype(dtype)
    check_checkpoint_every(checkpoint_every)
    if shard is not None and not recipe.shardable:
        raise KVRuntimeError(f"{recipe.kind} is compiled in one run: --shard does not apply")
    share = parse_shard(shard) if recipe.shardable else Shard()
    target = claim_output(resources, compile_target(out, model, recipe.kind, share), lock=share.writes_results)
    inputs = recipe.prepare(settings)
    loaded, tokenizer = load_model(model, device=device, dtype=dtype)
    recipe.check_model(settings, loaded)
    job = CompileJob(loaded, tokenizer, target, resume, checkpoint_every, share)
    artifact = recipe.run(job, settings, inputs)
    write_result(recipe, artifact, target, started, share, echo)
    if share.writes_results:
        recipe.written(job, artifact)
    return artifact


def write_result(recipe: Recipe | None, artifact: Any, out: Path, started: float, shard: Any, echo: Any) -> None:
    """Save the artifact with the command's wall time since `started` (a resumed run counts its last part only),
    then drop the run's checkpoints (only once the artifact is safely written), then draw its picture beside it and
    describe it. In a process group rank 0 writes; partial statistics of a separate job get no picture."""
    from kvcompile.calibration.checkpoint import discard_checkpoint
    from kvcompile.calibration.distributed import wait_for_all
    from kvcompile.calibration.partial_statistics import PARTIAL_KIND
    from kvruntime import save_artifact

    if shard.writes_results:
        artifact.provenance["compile_seconds"] = round(time.perf_counter() - started, 1)
        save_artifact(artifact, out)
    wait_for_all(shard)
    discard_checkpoint(out, shard)
    if not shard.writes_results:
        return
    echo(f"wrote {out}")
    if artifact.kind == PARTIAL_KIND:
        done, total = int(artifact.tensors["items_done"].sum()), artifact.params["items"]
        echo(f"partial statistics ({done} of {total} items): add the other shards with `kvcompile merge`")
        return
    echo(recipe.plot(artifact, out.with_suffix(".png")))
    description = recipe.describe(artifact)
    if description:
        echo(description)
