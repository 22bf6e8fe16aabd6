"""Every refusal of a bad argument, a bad option, a missing file or folder, an unknown task or oracle comes before
torch or transformers is imported (issue #31): each command runs in a subprocess whose import system refuses
torch and transformers, so a refusal that came after importing them would end in an ImportError traceback (exit 1)
instead of its one line (exit 2). The refusals' time is measured in benchmarks/performance/refusal_latency.py, not
here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcompile.recipe import artifact_folder, device_kind_possible

ARTIFACTS = artifact_folder("default")
PROMPT = str(Path(__file__).resolve().parent.parent / "calibration_data" / "prompts" / "passkey_2k.txt")
# The command line with torch and transformers made unimportable: what it refuses, it refuses without them.
BLOCKED_MAIN = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "transformers"):
            raise ImportError(name + " imported before the refusal")
sys.meta_path.insert(0, Refuse())
from kvcompile.cli import main
sys.argv[0] = "kvcompile"
main()
"""


def run_blocked(args: list[str], folder: Path) -> subprocess.CompletedProcess:
    # Bytecode written once (an environment that sets PYTHONDONTWRITEBYTECODE makes each of these 140 runs compile
    # the sources again, about 0.2 s each); __pycache__ is ignored by git.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    env["KVCOMPILE_CACHE"] = str(folder / "cache")
    return subprocess.run(
        [sys.executable, "-P", "-c", BLOCKED_MAIN, *args],
        input="y\n",  # what a "run the custom code?" prompt would read: nothing may ask
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _fifo(folder: Path) -> str:
    os.mkfifo(folder / "pipe")
    return "pipe"


def _user_file(folder: Path, name: str) -> str:
    (folder / name).write_text("the user's own file\n")
    return name


def _user_folder(folder: Path, name: str) -> str:
    (folder / name).mkdir()
    (folder / name / "notes.txt").write_text("the user's own file\n")
    return name


def _model_folder(folder: Path, config: dict) -> str:
    """A model folder holding `config` as its config.json and a tokenizer file (no weights: never loaded)."""
    (folder / "m").mkdir()
    (folder / "m" / "config.json").write_text(json.dumps(config))
    (folder / "m" / "tokenizer.json").write_text("{}")
    return "m"


def _link(folder: Path, name: str, target: str) -> str:
    (folder / name).symlink_to(target)
    return name


SUITE_LINE = '{"context": "c", "question": "q", "answers": ["a"]}\n'  # a good line of a user's suite


def _text(folder: Path, name: str, text: str) -> str:
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    return name


def _bundle(folder: Path, name: str, *kinds: str) -> str:
    """A bundle of the shipped artifacts of `kinds` (written with torch here, in the test; read without it there)."""
    from kvcompile.bundle import write_bundle

    write_bundle([ARTIFACTS / f"{kind}.safetensors" for kind in kinds], folder / name)
    return name


def _manifest_edited(folder: Path, edit: Callable[[dict], object]) -> str:
    """A bundle of the shipped kvcompose statistics whose manifest `edit` changed (a hostile or broken one)."""
    name = _bundle(folder, "edited", "kvcompose_stats")
    manifest = json.loads((folder / name / "manifest.json").read_text())
    edit(manifest)
    (folder / name / "manifest.json").write_text(json.dumps(manifest))
    return name


def _tuned_naming(folder: Path, names: list[str]) -> str:
    """The shipped tuned defaults, their recommendation naming `names` as the artifacts it needs."""
    from kvruntime.artifacts.artifact import read_artifact, save_artifact

    artifact = read_artifact(ARTIFACTS / "tuned_defaults.safetensors")
    artifact.params["recommended"]["artifacts"] = names
    save_artifact(artifact, folder / "tuned_defaults.safetensors")
    return "tuned_defaults.safetensors"


def _tuned_without_recommendation(folder: Path) -> str:
    """The shipped tuned defaults as a tuning that found no method within its tolerance writes them."""
    from kvruntime.artifacts.artifact import read_artifact, save_artifact

    artifact = read_artifact(ARTIFACTS / "tuned_defaults.safetensors")
    artifact.params["recommended"] = None
    save_artifact(artifact, folder / "tuned_defaults.safetensors")
    return "tuned_defaults.safetensors"


def _sized(folder: Path, name: str, size: int) -> str:
    (folder / name).write_text(json.dumps("x" * size) + "\n")
    return name


def _custom_code_folder(folder: Path, where: str) -> str:
    """A model folder with code of its own that, imported, writes a marker (issue #73's probe: transformers asks on
    stdin whether to run it, and a "y" ran it): an `auto_map` in its config or tokenizer config, or a lone .py."""
    model = folder / "m"
    model.mkdir()
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 16, "vocab_size": 64}
    tokenizer = {"tokenizer_class": "PreTrainedTokenizerFast"}
    mapping = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    if where in ("config", "tokenizer config"):
        (config if where == "config" else tokenizer)["auto_map"] = mapping
    (model / "config.json").write_text(json.dumps(config))
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    (model / "model.safetensors").write_bytes(b"")
    for name in ("configuration_evil.py", "modeling_evil.py"):
        (model / name).write_text(f"open({str(folder / ('ran-' + name))!r}, 'w').write('ran')\n")
    return "m"


def gguf_bytes(tensor_count: int = 1, metadata: dict | None = None, data: bytes = bytes(32)) -> bytes:
    """A GGUF file laid out by hand (GGUF v3: magic, version, counts, key/values, tensor infos, aligned data), with
    one float32 tensor of 8 elements unless the counts are crafted."""
    import struct

    def text(value: str) -> bytes:
        return struct.pack("<Q", len(value.encode())) + value.encode()

    pairs = {"general.architecture": "llama", "llama.block_count": 2, **(metadata or {})}
    head = b"GGUF" + struct.pack("<IQQ", 3, tensor_count, len(pairs))
    for key, value in pairs.items():
        head += text(key) + (
            struct.pack("<I", 8) + text(value) if isinstance(value, str) else struct.pack("<II", 4, value)
        )
    head += text("token_embd.weight") + struct.pack("<IQIQ", 1, 8, 0, 0)  # 1 dimension of 8, float32, offset 0
    return head + bytes(-len(head) % 32) + data


def _gguf(folder: Path, name: str, content: bytes) -> str:
    (folder / name).write_bytes(content)
    return name


HOSTILE_GGUFS = {
    "empty": b"",
    "badmagic": b"GGML" + gguf_bytes()[4:],
    "header_only": gguf_bytes()[:24],
    "truncated": gguf_bytes()[:-8],
    "huge_tensors": gguf_bytes(tensor_count=1 << 60),
    "huge_kv": b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little") + (1 << 62).to_bytes(8, "little"),
    "huge_keylen": b"GGUF" + (3).to_bytes(4, "little") + bytes(8) + (1).to_bytes(8, "little") + (1 << 62).to_bytes(8, "little"),
    "100k layers": gguf_bytes(metadata={"llama.block_count": 100_000}),
}  # fmt: skip


def _suite_bomb(folder: Path, kind: str) -> str:
    """A suite of the probe's: a small file that reads into a gigabyte, or a 10 MB context (issue #73)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    bomb = folder / "bomb"
    bomb.mkdir()
    if kind.startswith("context"):
        words = 5_000_000 if kind == "context of 10 MB" else 500_000
        (bomb / "rows.jsonl").write_text(json.dumps({"context": "x " * words, "question": "q", "answers": ["a"]}))
    elif kind == "line":
        with open(bomb / "rows.jsonl", "wb") as handle:  # a 2 GB line, sparse on disk
            handle.truncate(2 << 30)
    elif kind == "arrow":
        schema = pa.schema([("context", pa.string()), ("question", pa.string()), ("answers", pa.list_(pa.string()))])
        batch = pa.record_batch(
            [pa.array(["x" * (1 << 20)] * 16), pa.array(["q"] * 16), pa.array([["a"]] * 16)], schema
        )
        options = pa.ipc.IpcWriteOptions(compression="zstd")
        with pa.OSFile(str(bomb / "data.arrow"), "wb") as sink, pa.ipc.new_stream(sink, schema, options=options) as out:
            for _ in range(64):
                out.write_batch(batch)
        (bomb / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data.arrow"}]}))
    else:  # parquet: one 16 KiB value in each of 60,000 dictionary-encoded rows
        rows = 60_000
        context = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array(["x" * (16 << 10)]))
        table = pa.table({"context": context, "question": ["q"] * rows, "answers": [["a"]] * rows})
        pq.write_table(table, str(bomb / "part.parquet"), store_schema=False, compression="zstd")
    return "bomb"


def _results_run(folder: Path, make: Callable[[Path], object]) -> str:
    """An eval folder for `bundle --results` whose runs.jsonl `make` makes (a pipe, a link to /dev/zero)."""
    run = folder / "run"
    run.mkdir()
    make(run / "runs.jsonl")
    return "run"


def _listed_many_times(manifest: dict) -> None:
    entry = {key: manifest["artifacts"][0][key] for key in ("file", "kind", "sha256")}
    manifest["artifacts"] = [entry] * 20_000


GENERATE = ["generate", "--prompt-file", PROMPT]
BUNDLE_HEADS = ["bundle", str(ARTIFACTS / "srh_heads.safetensors")]
# name -> (arguments, made in the folder the command runs in; a part of the one line it must print)
CASES: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "missing prompt": (lambda d: ["generate", "--prompt-file", "nope.txt"], "prompt file nope.txt does not exist"),
    "prompt is a pipe": (
        lambda d: ["generate", "--prompt-file", _fifo(d)],
        "prompt file pipe is not a regular file",
    ),
    "unknown method": (lambda d: [*GENERATE, "--method", "foo"], "unknown method 'foo'"),
    "a JSONL line that is not JSON": (
        lambda d: ["generate", "--prompt-file", _text(d, "p.jsonl", '"a prompt"\n{oops\n')],
        "line 2 of p.jsonl is not JSON",
    ),
    "a JSONL line without a prompt": (
        lambda d: ["generate", "--prompt-file", _text(d, "q.jsonl", '{"text": "no prompt key"}\n')],
        "line 1 of q.jsonl holds no prompt",
    ),
    "a batch of no prompts": (
        lambda d: [*GENERATE, "--batch-size", "0"],
        "--batch-size 0: give at least 1 prompt per batch",
    ),
    "option of the wrong type": (
        lambda d: [*GENERATE, "--method", "kvcompose", "--option", "unstructured=maybe"],
        "kvcompose option unstructured='maybe' is not a boolean",
    ),
    "unstructured with padded memory": (
        lambda d: [*GENERATE, "--method", "kvcompose", "--option", "unstructured=true", "--option", "mode=dynamic"],
        "use memory='masked'",
    ),
    "budget not compiled for compilerkv, without nearest budget": (
        lambda d: [*GENERATE, "--method", "compilerkv", "--budget", "300"],
        "not 300: pass it (--budget)",
    ),
    "nearest budget for a tuned method that is not compilerkv": (
        lambda d: [*GENERATE, "--nearest-budget"],
        # the shipped tuned defaults recommend compresskv (srh+error-aware): said so, not its options listed
        "--nearest-budget moves --budget to the nearest compiled budget, and the tuned default "
        "(tuned_defaults.safetensors) chose compresskv, which compiles none: give --method compilerkv with it, or leave it out",
    ),
    "nearest budget for the runtime's default method (no tuned default among the artifacts)": (
        lambda d: [*GENERATE, "--nearest-budget", "--artifact", str(ARTIFACTS / "srh_heads.safetensors")],
        "and without --method or a tuned default, the method is kvcompress, which compiles none: give --method "
        "compilerkv with it",
    ),
    "a tuned default that recommends nothing": (
        lambda d: [*GENERATE, "--artifact", _tuned_without_recommendation(d)],
        "tuning found no method within",
    ),
    "budget compilerkv did not compile": (
        lambda d: [*GENERATE, "--method", "compilerkv", "--budget", "300"],
        "compiled for budget 256 tokens per layer, not 300",
    ),
    "ratio outside kvcompose's compiled ratios": (
        lambda d: [*GENERATE, "--method", "kvcompose", "--ratio", "0.99"],
        "ratio 0.99 is outside the compiled ratios",
    ),
    "chunks for a method that cannot stream": (
        lambda d: [*GENERATE, "--method", "kvcompress", "--prefill-chunk-size", "512"],
        "kvcompress cannot stream the prefill in chunks",
    ),
    "chunk smaller than the tuned default's window": (
        lambda d: [*GENERATE, "--prefill-chunk-size", "4"],
        "prefill_chunk_size 4 is smaller than compresskv's window of 8 tokens: the last chunk must hold the window "
        "(compresskv is what the tuned default tuned_defaults.safetensors chose)",
    ),
    "chunk size not a number": (
        lambda d: [*GENERATE, "--prefill-chunk-size", "abc"],
        "Invalid value for '--prefill-chunk-size'",
    ),
    "missing artifact without a method": (
        lambda d: [*GENERATE, "--artifact", "nope.safetensors"],
        "nope.safetensors: no such artifact file",
    ),
    "budget past the model's positions": (
        lambda d: [*GENERATE, "--method", "snapkv", "--budget", "99999999999"],
        "--budget 99999999999 tokens per layer: 99999999999 positions, more than the model's 8192",
    ),
    "missing model folder": (
        lambda d: [*GENERATE, "--method", "snapkv", "--model", str(d / "no-model")],
        "not found: give a local model directory",
    ),
    "an option that is not finite": (
        lambda d: [*GENERATE, "--method", "distilled", "--option", "leverage=nan"],
        "distilled option leverage=nan is not finite",
    ),
    "an option outside its range": (
        lambda d: [*GENERATE, "--method", "distilled", "--option", "floor=2"],
        "distilled option floor=2.0: give a value in [0.0, 1.0]",
    ),
    "a bundle without the method's artifact": (
        lambda d: [*GENERATE, "--method", "srh", "--artifact", _bundle(d, "b", "kvcompose_stats")],
        "method 'srh' needs a srh_heads artifact",
    ),
    "a tuned default naming a file outside its folder": (
        lambda d: [*GENERATE, "--artifact", _tuned_naming(d, ["../srh_heads.safetensors"])],
        "its recommendation names a file outside its folder",
    ),
    "a tuned default naming a file by an absolute path": (
        lambda d: [*GENERATE, "--artifact", _tuned_naming(d, ["/etc/hostname"])],
        "its recommendation names a file outside its folder",
    ),
    "a bundled tuned default naming a file its bundle does not hold": (
        lambda d: [*GENERATE, "--artifact", _bundle(d, "b", "tuned_defaults")],
        "its recommendation names srh_heads.safetensors, which its bundle does not hold",
    ),
    "--max-new-tokens past the model's positions": (
        lambda d: [*GENERATE, "--max-new-tokens", "9000"],
        "--max-new-tokens 9000: 9000 positions, more than the model's 8192",
    ),
    "a JSONL line nested past Python's limits": (
        lambda d: ["generate", "--prompt-file", _text(d, "deep.jsonl", "[" * 100_000 + "\n")],
        "line 1 of deep.jsonl is JSON past Python's limits",
    ),
    "a JSONL line with a 100,000-digit number": (
        lambda d: ["generate", "--prompt-file", _text(d, "digits.jsonl", "1" * 100_000 + "\n")],
        "line 1 of digits.jsonl is JSON past Python's limits",
    ),
    "a JSONL prompt with a lone surrogate": (
        lambda d: ["generate", "--prompt-file", _text(d, "s.jsonl", '"a prompt \\ud800 with half a character"\n')],
        "line 1 of s.jsonl holds a lone surrogate",
    ),
    "a 10 MB prompt, past the positions in bytes alone": (
        lambda d: ["generate", "--prompt-file", _sized(d, "big.jsonl", 10_000_000)],
        "prompt big.jsonl:1 is 10,000,000 bytes: more than the model's 8,192 positions can hold",
    ),
    "bundle: --out the current folder": (
        lambda d: ["bundle", str(ARTIFACTS / "srh_heads.safetensors"), "--out", "."],
        "--out . holds the current folder",
    ),
    "bundle: --out a folder of the user's files with a manifest.json": (
        lambda d: [
            "bundle",
            str(ARTIFACTS / "srh_heads.safetensors"),
            "--out",
            _user_folder(d, "ext"),
            _text(d, "ext/manifest.json", "{}") and "--base-model",
            "x/y",
        ],
        "--out ext holds files that `kvcompile bundle` did not write there",
    ),  # fmt: skip
    "bundle: --out a symbolic link": (
        lambda d: [
            "bundle",
            str(ARTIFACTS / "srh_heads.safetensors"),
            "--out",
            _link(d, "link", _bundle(d, "b", "srh_heads")),
        ],
        "--out link is a symbolic link",
    ),
    "reproduce: no terminal to ask and no --yes": (
        lambda d: ["reproduce", _bundle(d, "b", "kvcompose_stats")],
        "pass --yes to run them without a terminal to ask",
    ),
    "info: a manifest whose provenance is a string": (
        lambda d: ["info", _manifest_edited(d, lambda m: m["artifacts"][0].update(provenance="kvcompile stats"))],
        "malformed manifest (kvcompose_stats.safetensors's provenance is not an object)",
    ),
    "info: a manifest whose command is a number": (
        lambda d: ["info", _manifest_edited(d, lambda m: m["artifacts"][0]["provenance"].update(command=7))],
        "malformed manifest (kvcompose_stats.safetensors's command is not a line of printable text)",
    ),
    "info: a manifest whose command holds an escape sequence": (
        lambda d: ["info", _manifest_edited(d, lambda m: m["artifacts"][0]["provenance"].update(command="\x1b[2J"))],
        "malformed manifest (kvcompose_stats.safetensors's command is not a line of printable text)",
    ),
    "info: a manifest whose file name holds an escape sequence": (
        lambda d: ["info", _manifest_edited(d, lambda m: m["artifacts"][0].update(file="\x1b[2Jx.safetensors"))],
        "malformed manifest (an artifact's file is not a file name in the bundle)",
    ),
    "info: a manifest of 200 MB": (
        lambda d: ["info", _bundle(d, "b", "srh_heads") and _sized(d, "b/manifest.json", 200_000_000) and "b"],
        "not a readable manifest (200000003 bytes, more than a manifest's 4194304)",
    ),
    "eval: an option outside its range": (
        lambda d: ["eval", "--methods", "distilled:leverage=-1"],
        "distilled option leverage=-1.0: give a value at least 0.0",
    ),
    "tune: an option that is not finite": (
        lambda d: ["tune", "--methods", "distilled:leverage=inf"],
        "distilled option leverage=inf is not finite",
    ),
    "a hub id not in the local cache": (
        lambda d: [*GENERATE, "--model", "nobody/no-such-model"],
        "model 'nobody/no-such-model' not found: give a local model directory, a GGUF file, a hub id in the local "
        "cache",
    ),
    "eval: --resume from a corrupt run.json": (
        lambda d: [
            "eval",
            "--resume",
            "--out",
            _text(d, "run/run.json", "{oops") and _text(d, "run/runs.jsonl", "") and "run",
            "--methods",
            "full,snapkv",
            "--tasks",
            "passkey",
            "--samples",
            "1",
        ],
        "cannot resume from run/run.json: is not JSON",
    ),  # fmt: skip
    "generate: a bit width not offered": (lambda d: [*GENERATE, "--kv-bits", "3"], "kv_bits=3: give one of 8, 4"),
    "generate: --kv-bits with a batch": (
        lambda d: [*GENERATE, "--kv-bits", "8", "--batch-size", "2"],
        "--kv-bits quantizes one prompt at a time: leave --batch-size at 1",
    ),
    "eval: a contestant's bit width not offered": (
        lambda d: ["eval", "--methods", "snapkv:kv_bits=5"],
        "kv_bits=5: give one of 8, 4",
    ),
    "eval --suite: a line without a context": (
        lambda d: ["eval", "--suite", _text(d, "mine.jsonl", SUITE_LINE + '{"question": "q", "answers": ["a"]}\n')],
        "mine.jsonl line 2: no 'context' (give a non-empty string)",
    ),
    "eval --suite: an empty list of answers": (
        lambda d: ["eval", "--suite", _text(d, "mine.jsonl", '{"context": "c", "question": "q", "answers": []}')],
        "mine.jsonl line 1: no 'answers' (give a non-empty list of the accepted answers)",
    ),
    "eval --suite: a line that is not JSON": (
        lambda d: ["eval", "--suite", _text(d, "mine.jsonl", SUITE_LINE + "\n\n{oops\n")],
        "mine.jsonl line 4: not JSON",
    ),
    "eval --suite: a missing file": (lambda d: ["eval", "--suite", "none.jsonl"], "no such file or folder"),
    "eval --suite: an unknown scoring": (
        lambda d: ["eval", "--suite", _text(d, "mine.jsonl", SUITE_LINE), "--scoring", "bleu"],
        "--scoring 'bleu': use one of all, fraction, substring, exact, f1",
    ),
    "eval --suite with the built-in suite's --tasks": (
        lambda d: ["eval", "--suite", _text(d, "mine.jsonl", SUITE_LINE), "--tasks", "passkey"],
        "--tasks picks the built-in suite's prompts: it does not apply with --suite",
    ),
    "eval --scoring without a suite": (
        lambda d: ["eval", "--scoring", "f1"],
        "--scoring scores a --suite of your own",
    ),
    "tune --suite: a line without a question": (
        lambda d: ["tune", "--suite", _text(d, "mine.jsonl", '{"context": "c", "answers": ["a"]}')],
        "mine.jsonl line 1: no 'question'",
    ),
    # Issue #61: a suite is read as a folder of the user's files (tests/test_own_suite.py has every shape).
    "eval --suite: a FIFO": (lambda d: ["eval", "--suite", _fifo(d)], "--suite pipe: not a file or a folder"),
    "eval --suite: /dev/zero": (lambda d: ["eval", "--suite", "/dev/zero"], "--suite /dev/zero: not a file or a"),
    "eval --suite: a folder whose state.json names a file outside it": (
        lambda d: ["eval", "--suite", _text(d, "s/state.json", '{"_data_files": [{"filename": "/etc/passwd"}]}')[:1]],
        "state.json names '/etc/passwd': a suite's data files are .arrow files inside its folder",
    ),
    "eval --suite: a folder whose dataset_dict.json names a split outside it": (
        lambda d: ["eval", "--suite", _text(d, "s/dataset_dict.json", '{"splits": ["../../outside/ds2"]}')[:1]],
        "dataset_dict.json lists no splits that are folders inside it",
    ),
    "eval --suite: a line nested 100,000 deep": (
        lambda d: ["eval", "--suite", _text(d, "mine.jsonl", '{"context": ' + "[" * 100_000 + "]" * 100_000 + "}")],
        "mine.jsonl line 1: nested too deep to read",
    ),
    "eval --suite: a folder holding a line nested 100,000 deep": (
        lambda d: ["eval", "--suite", _text(d, "s/rows.jsonl", "[" * 100_000)[:1]],
        "rows.jsonl line 1: nested too deep to read",
    ),
    "eval --suite: a 5,000-digit id": (
        lambda d: ["eval", "--suite", _text(d, "mine.jsonl", SUITE_LINE[:-2] + ', "id": ' + "9" * 5000 + "}")],
        "mine.jsonl line 1: holds a number too long to read",
    ),
    "eval --suite: a misspelled field": (
        lambda d: ["eval", "--suite", _text(d, "mine.jsonl", SUITE_LINE[:-2] + ', "answer_prefx": "A:"}')],
        "mine.jsonl line 1: unknown field 'answer_prefx' (known: context, question, answers, answer_prefix, id)",
    ),
    "tune --suite with the built-in suite's --seed": (
        lambda d: ["tune", "--suite", _text(d, "mine.jsonl", SUITE_LINE), "--seed", "3"],
        "--seed picks the built-in suite's prompts: it does not apply with --suite",
    ),
    "tune --scoring without a suite": (lambda d: ["tune", "--scoring", "f1"], "--scoring scores a --suite of your own"),
    "generate: an --option given twice": (
        lambda d: [*GENERATE, "--method", "snapkv", "--option", "window=8", "--option", "window=16"],
        "--option 'window' is given twice: give each option once",
    ),
    "bundle: a --base-model that would write YAML": (
        lambda d: ["bundle", str(ARTIFACTS / "srh_heads.safetensors"), "--out", "b", "--base-model", "x/y\nlicense: a"],
        "--base-model 'x/y\\nlicense: a': give the model's hub repo id (org/name)",
    ),
    "bundle: --results a file": (
        lambda d: ["bundle", str(ARTIFACTS / "srh_heads.safetensors"), "--out", "b", "--results", "/etc/passwd"],
        "--results /etc/passwd: not a folder (give the --out folder of a kvcompile eval run)",
    ),
    **(
        {
            "eval on CUDA where the machine has no driver for it": (
                lambda d: ["eval", "--device", "cuda"],
                "--device 'cuda': this machine has no CUDA device",
            )
        }
        if not device_kind_possible("cuda")
        else {}
    ),
    "eval on MPS off a Mac": (lambda d: ["eval", "--device", "mps"], "--device 'mps': this machine has no MPS device"),
    # Issue #62: a model the runtime cannot compress is refused from its config.json, before a minute of loading.
    "generate: a model whose attention needs eager": (
        lambda d: [*GENERATE, "--model", _model_folder(d, {"model_type": "bloom", "num_hidden_layers": 2})],
        "model type 'bloom' does not run its attention through transformers' attention interface as sdpa",
    ),
    "generate: a model with chunked layers": (
        lambda d: [
            *GENERATE,
            "--model",
            _model_folder(d, {"model_type": "llama4_text", "layer_types": ["chunked_attention", "full_attention"]}),
        ],
        "model type 'llama4_text' has chunked_attention layers",
    ),  # fmt: skip
    "heads: a model whose every layer is a sliding window": (
        lambda d: [
            "heads",
            "--model",
            _model_folder(d, {"model_type": "mistral", "sliding_window": 64, "num_hidden_layers": 2}),
        ],
        "every layer of model type 'mistral' is a sliding window",
    ),  # fmt: skip
    # Issue #73: a model folder, a GGUF file and a config are hostile input too.
    **{
        f"generate: a model folder with code of its own in its {where}": (
            lambda d, where=where: [*GENERATE, "--model", _custom_code_folder(d, where)],
            f"model 'm' ships code of its own ({shown}): kvcompile never runs a model folder's code",
        )
        for where, shown in (
            ("config", "config.json's auto_map"),
            ("tokenizer config", "tokenizer_config.json's auto_map"),
            ("folder", "configuration_evil.py"),
        )
    },
    **{
        f"generate: a GGUF file, {name}": (
            lambda d, content=content: [*GENERATE, "--model", _gguf(d, "model.gguf", content)],
            "GGUF file model.gguf is not a readable model: " if name != "100k layers" else "gives 100000 layers",
        )
        for name, content in HOSTILE_GGUFS.items()
    },
    "generate: a file that is no GGUF": (
        lambda d: [*GENERATE, "--model", _text(d, "model.bin", "not a model")],
        "GGUF file model.bin is not a readable model: it does not start with GGUF's magic bytes",
    ),
    "generate: an empty --model": (lambda d: [*GENERATE, "--model", ""], "--model is empty"),
    **{
        f"generate: a config with {key} = {value!r}": (
            lambda d, key=key, value=value: [
                *GENERATE,
                "--model",
                _model_folder(d, {"model_type": "llama", "num_hidden_layers": 2, key: value}),
            ],
            f"the model's config gives {key} = {value!r}: a positive integer of at most",
        )
        for key, value in (
            ("num_hidden_layers", 100_000),
            ("num_hidden_layers", 10_000),
            ("num_hidden_layers", "2"),
            ("num_attention_heads", -1),
            ("hidden_size", True),
            ("vocab_size", 1 << 40),
        )
    },  # fmt: skip
    "generate: a config of more weights than the machine holds": (
        lambda d: [
            *GENERATE,
            "--model",
            _model_folder(
                d, {"model_type": "llama", "num_hidden_layers": 1000, "hidden_size": 65536, "vocab_size": 1 << 20}
            ),
        ],
        "GiB of float32 weights, more than this machine's",
    ),  # fmt: skip
    "generate: an unknown model type": (
        lambda d: [*GENERATE, "--model", _model_folder(d, {"model_type": "evil_model", "num_hidden_layers": 2})],
        "model type 'evil_model' is not one this transformers",
    ),
    "generate: a model folder without weights": (
        lambda d: [*GENERATE, "--model", _model_folder(d, {"model_type": "llama", "num_hidden_layers": 2})],
        "model 'm' has no weights",
    ),
    "generate: kv_bits on a hybrid model": (
        lambda d: [*GENERATE, "--model", "gemma-3-270m", "--kv-bits", "8"],
        "kv_bits quantizes the cache's growing layers",
    ),
    "generate: a batch on a hybrid model": (
        lambda d: [*GENERATE, "--prompt-file", PROMPT, "--model", "gemma-3-270m", "--batch-size", "2"],
        "a batch (or a padded prompt) on a model with sliding-window layers",
    ),
    "generate: chat on a base model": (
        lambda d: [*GENERATE, "--model", "gemma-3-270m", "--prompt-format", "chat"],
        "the model's tokenizer has no chat template",
    ),
    "eval: a batch on a hybrid model": (
        lambda d: ["eval", "--model", "gemma-3-270m", "--methods", "snapkv", "--batch-size", "2"],
        "a batch (or a padded prompt) on a model with sliding-window layers",
    ),
    "tune: chat on a base model": (
        lambda d: ["tune", "--model", "gemma-3-270m", "--prompt-format", "chat"],
        "the model's tokenizer has no chat template",
    ),
    "eval: kv_bits on a hybrid model": (
        lambda d: ["eval", "--model", "gemma-3-270m", "--methods", "full:kv_bits=8"],
        "kv_bits quantizes the cache's growing layers",
    ),
    **{
        f"eval: a suite bomb, {kind}": (
            lambda d, kind=kind: ["eval", "--methods", "snapkv", "--suite", _suite_bomb(d, kind)],
            message,
        )
        for kind, message in (
            ("context of 10 MB", "10,000,007 characters, more than the 4,194,304 a row may hold"),
            ("context of 1 MB", "characters, more than the model's 8,192 positions can hold"),
            ("line", "rows.jsonl: more than the 256 MiB a suite may hold"),
            ("arrow", "data.arrow: more than the 256 MiB a suite may hold"),
            ("parquet", "part.parquet: more than the 256 MiB"),
        )
    },
    **{
        f"bundle --results: runs.jsonl {what}": (
            lambda d, make=make: [*BUNDLE_HEADS, "--out", "b", "--results", _results_run(d, make)],
            message,
        )
        for what, make, message in (
            ("a pipe", os.mkfifo, "runs.jsonl is not a regular file"),
            ("a link to /dev/zero", lambda path: path.symlink_to("/dev/zero"), "runs.jsonl is a symbolic link"),
        )
    },
    "info: a manifest listing one file 20,000 times": (
        lambda d: ["info", _manifest_edited(d, _listed_many_times)],
        "(20000 artifact entries, more than a bundle's 256)",
    ),
    "eval: unknown task": (lambda d: ["eval", "--tasks", "foo"], "unknown tasks ['foo']"),
    "eval: a length past the model's positions": (
        lambda d: ["eval", "--lengths", "20k", "--methods", "snapkv"],
        "--lengths 20480 and 48 new tokens: 20528 positions, more than the model's 8192",
    ),
    "eval: unknown method": (lambda d: ["eval", "--methods", "foo"], "unknown method 'foo'"),
    "eval: a batch of no prompts": (
        lambda d: ["eval", "--methods", "snapkv", "--batch-size", "0"],
        "--batch-size 0: give at least 1 prompt per batch",
    ),
    "eval: an output folder of other files": (
        lambda d: ["eval", "--methods", "snapkv", "--out", _user_folder(d, "mine")],
        "--out mine holds files that are not a kvcompile run's",
    ),
    "distill: unknown oracle": (lambda d: ["distill", "--oracle", "foo"], "--oracle 'foo': use one of"),
    "distill: --out a picture's name": (
        lambda d: ["distill", "--out", "x.png"],
        "--out x.png: an artifact's name ends in .safetensors",
    ),
    "distill: --out a file that is not its artifact": (
        lambda d: ["distill", "--out", _user_file(d, "mine.safetensors")],
        "--out mine.safetensors exists and is not a distilled_scorer or partial_statistics artifact",
    ),
    "distill: the picture's name taken by another file": (
        lambda d: ["distill", "--out", "s.safetensors", "--corpus", _user_file(d, "s.png")],
        "its picture's name s.png is taken by a file that is not a PNG",
    ),
    "distill: --out in a folder nothing can be written in": (
        lambda d: ["distill", "--out", "/proc/kvcompile-test.safetensors"],
        "--out /proc/kvcompile-test.safetensors: cannot write in /proc",
    ),
    "distill: a length past the model's positions": (
        lambda d: ["distill", "--prompt-tokens", "5000"],
        "--prompt-tokens 5000 read twice (the second pass): 10000 positions, more than the model's 8192",
    ),
    "distill: more lookahead queries than a scorer holds": (
        lambda d: ["distill", "--lookahead-queries", "300"],
        "--lookahead-queries must be between 0 and 256",
    ),
    "distill: lookahead queries trained on no context": (
        lambda d: ["distill", "--lookahead-prompts", "0"],
        "--lookahead-steps and --lookahead-prompts must be at least 1",
    ),
    "stats: ratio out of range": (lambda d: ["stats", "--ratios", "1.5"], "--ratios [1.5]: give ratios strictly"),
    "stats: missing task set": (
        lambda d: ["stats", "--task-set", "nope.txt", "--out", "s.safetensors"],
        "task set nope.txt does not exist",
    ),
    "stats: missing corpus": (
        lambda d: ["stats", "--corpus", "nope.txt", "--out", "s.safetensors"],
        "corpus nope.txt does not exist",
    ),
    "tune: unknown method": (lambda d: ["tune", "--methods", "foo"], "unknown method 'foo'"),
    "tune: the run records' folder taken by other files": (
        lambda d: ["tune", "--methods", "snapkv", "--out", _user_folder(d, "t.runs").replace(".runs", ".safetensors")],
        "t.runs holds files that are not a kvcompile run's",
    ),
    "tune: another file of a method's artifact's name beside --out": (
        lambda d: [
            "tune",
            "--methods",
            "snapkv,srh",
            "--out",
            str(Path(_text(d, "t/srh_heads.safetensors", "mine")).with_name("tuned.safetensors")),
        ],
        "holds another srh_heads.safetensors than the one tuned with",
    ),
    "heads: a length past the model's positions": (
        lambda d: ["heads", "--lengths", "99999"],
        "--lengths 99999: 99999 positions, more than the model's 8192",
    ),
    "tables: budget below the window": (lambda d: ["tables", "--budgets", "0"], "--budgets must lie between"),
    "tables: an unknown experience design": (lambda d: ["tables", "--design", "all"], "--design 'all': use one of"),
    "tables: an unknown loss": (lambda d: ["tables", "--loss", "mse"], "--loss 'mse': use one of nll, kl"),
    "tables: the experience's name taken by another file": (
        lambda d: ["tables", "--out", _user_file(d, "t.experience.safetensors").replace(".experience", "")],
        "t.experience.safetensors exists and is not a compilerkv_experience artifact",
    ),
    "tables: relearning from an artifact of another kind": (
        lambda d: ["tables", "--from-experience", str(ARTIFACTS / "srh_heads.safetensors"), "--out", "t.safetensors"],
        "a srh_heads artifact, not compilerkv_experience",
    ),
    "layer-errors: missing heads artifact": (
        lambda d: ["layer-errors", "--heads", "nope.safetensors", "--out", "b.safetensors"],
        "nope.safetensors: no such artifact file",
    ),
    "unknown device": (lambda d: ["stats", "--device", "tpu"], "--device 'tpu': use cpu, cuda, cuda:N or mps"),
    "eval on an unknown device": (
        lambda d: ["eval", "--device", "gpu"],
        "--device 'gpu': use cpu, cuda, cuda:N or mps",
    ),
    "unknown dtype": (lambda d: ["stats", "--dtype", "int8"], "--dtype 'int8': use one of"),
    "bad shard": (lambda d: ["stats", "--shard", "3/2"], "--shard '3/2': i must lie in [0, n)"),
    "merge: --out one of the partials": (
        lambda d: ["merge", _user_file(d, "a.safetensors"), "--out", "a.safetensors"],
        "--out a.safetensors is one of the partials being merged",
    ),
    "merge: a missing partial": (
        lambda d: ["merge", "nope.safetensors", "--out", "m.safetensors"],
        "nope.safetensors: no such artifact file",
    ),
    "merge: not partial statistics": (
        lambda d: ["merge", str(ARTIFACTS / "srh_heads.safetensors"), "--out", "m.safetensors"],
        "is not partial statistics",
    ),
    "info: a missing file": (lambda d: ["info", "nope.safetensors"], "nope.safetensors: no such artifact file"),
    "info: not an artifact": (
        lambda d: ["info", _text(d, "notes.safetensors", "notes")],
        "not a readable safetensors file",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_refused_in_one_line_before_torch_is_imported(tmp_path, case):
    make, message = CASES[case]
    args = make(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = run_blocked(args, tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert not list(tmp_path.glob("ran-*"))  # no code of a model folder's ran
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0]
    assert result.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == before  # nothing written


def test_the_blocker_catches_a_refusal_made_after_torch_loads(tmp_path):
    """The harness itself: a command that gets as far as loading the model fails here, loudly."""
    result = run_blocked([*GENERATE, "--method", "snapkv", "--max-new-tokens", "1"], tmp_path)
    assert result.returncode == 1 and "imported before the refusal" in result.stderr
