"""Fuzzing the artifact loader: whatever the bytes, `read_artifact` and `load_artifact` return a valid artifact or
raise the runtime's own errors (KVRuntimeError and its subclasses), never a ValueError, KeyError, a safetensors or
JSON error; and an artifact that loads can be used by the method that needs it without crashing deep inside."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import struct
import tempfile
import warnings
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_artifact import _rewrite_metadata

import kvruntime
from kvruntime.artifacts.artifact import (
    KNOWN_KINDS,
    Artifact,
    load_artifact,
    read_artifact,
    save_artifact,
    tensors_checksum,
)
from kvruntime.artifacts.fingerprint import ModelFingerprint, model_fingerprint
from kvruntime.artifacts.tuned_defaults import TunedDefaults
from kvruntime.errors import KVRuntimeError

# KVCOMPILE_FUZZ_EXAMPLES=3000 for a longer search (about 2 minutes); the default keeps this file near 5 s.
FUZZ = settings(
    max_examples=int(os.environ.get("KVCOMPILE_FUZZ_EXAMPLES", 100)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
PROMPT = torch.randint(3, 96, (1, 160), generator=torch.Generator().manual_seed(0))


@functools.cache
def model() -> torch.nn.Module:
    return tiny_model("llama")


def valid_tensors() -> dict[str, dict[str, torch.Tensor]]:
    """Plausible tensors of every kind for the tiny Llama (4 layers, 4 query heads, 2 KV heads)."""
    g = torch.Generator().manual_seed(0)
    return {
        "srh_heads": {"srh_score": torch.rand(4, 4, generator=g), "successful_probes": torch.tensor(3)},
        "layer_budgets": {
            "layer_error": torch.tensor([0.1, 0.4, 0.2, 0.3]),
            "raw_error": torch.rand(2, 4, generator=g),
        },
        "compilerkv_tables": {
            "budgets": torch.tensor([70, 100]),
            "head_reliability": 0.8 + 0.7 * torch.rand(2, 4, 4, generator=g),
            "risk_thresholds": 0.8 + 0.2 * torch.rand(2, 4, 3, 2, generator=g),
            "entropy_edges": torch.tensor([3.0, 3.5], dtype=torch.float64),
            "perplexity_edges": torch.tensor([90.0], dtype=torch.float64),
        },
        "compilerkv_experience": {
            "budgets": torch.tensor([70, 100]),
            "prompt_full_nll": torch.rand(3, dtype=torch.float64, generator=g),
            "prompt_entropy": torch.rand(3, dtype=torch.float64, generator=g),
            "prompt_perplexity": torch.rand(3, dtype=torch.float64, generator=g),
            "prompt_candidate": torch.tensor([4, 0, 2]),
            "candidate_risks": torch.rand(5, 2, dtype=torch.float64, generator=g),
        },
        "kvcompose_stats": {
            "ratios": torch.tensor([0.25, 0.5, 0.75]),
            "layer_fractions": torch.tensor([[0.75] * 4, [0.5] * 4, [0.25] * 4]),
            "head_fractions": torch.tensor([[[0.75] * 2] * 4, [[0.5] * 2] * 4, [[0.25] * 2] * 4]),
        },
        "tuned_defaults": {"full_accuracy": torch.tensor([0.9]), "ratios": torch.tensor([0.25, 0.5])},
        "distilled_scorer": {
            "weights": torch.randn(4, 64 + 4, 2, generator=g),  # [layers, hidden + 4 features, KV heads]
            "share_ratios": torch.tensor([0.25, 0.5]),
            "layer_shares": torch.tensor([[0.25] * 4, [0.1, 0.2, 0.3, 0.4]]),
        },
        "partial_statistics": {"xtx": torch.rand(4, 3, 3, dtype=torch.float64, generator=g)},  # for `kvcompile merge`
        # A saved context of 80 tokens, each layer's last 10 kept: [1, KV heads, slots, head dim]
        "compressed_context": {
            f"{kind}.{layer}": tensor
            for layer in range(4)
            for kind, tensor in (
                ("keys", torch.randn(1, 2, 10, 16, generator=g)),
                ("values", torch.randn(1, 2, 10, 16, generator=g)),
                ("positions", torch.arange(70, 80, dtype=torch.int32).expand(1, 2, 10).contiguous()),
            )
        },
    }


PARAMS = {
    "compressed_context": {
        "context_length": 80,
        "layers": 4,
        "prompt_format": "raw",
        "question_separator": "",
        "tokenizer_sha256": "0" * 64,
        "method": "snapkv",
        "requested": "ratio 0.5",
    },  # fmt: skip
    "distilled_scorer": {"oracle": "reconstruction", "share_floor": 0.25},
    "tuned_defaults": {
        "tolerance": 0.02,
        "recommended": {"method": "snapkv", "options": {}, "ratio": 0.5, "accuracy": 0.9, "artifacts": []},
    },
}


def artifact_of(kind: str, tensors: dict[str, torch.Tensor] | None = None) -> Artifact:
    return Artifact(
        kind=kind,
        tensors=valid_tensors()[kind] if tensors is None else tensors,
        model=model_fingerprint(model()),
        provenance={"command": "test", "seed": 0},
        params=PARAMS.get(kind, {"note": "fuzz"}),
    )


@functools.cache
def valid_bytes(kind: str) -> bytes:
    with tempfile.TemporaryDirectory() as folder:
        return save_artifact(artifact_of(kind), Path(folder) / "a.safetensors").read_bytes()


def use(path: Path, kind: str) -> tuple[int, int] | None:
    """What the runtime does with an artifact of `kind`: build the method that needs it and run a prefill. Returns
    the entries the compressed cache holds and the entries asked for (None for kinds no method reads)."""
    artifact = load_artifact(path, model=model(), kind=kind)
    if kind == "tuned_defaults":
        TunedDefaults.from_artifact(artifact)
        return None
    if kind in ("compilerkv_experience", "partial_statistics"):  # read by the compile stage only
        return None
    if kind == "compressed_context":  # answered from: a question's first token after it
        with kvruntime.load_context(model(), path) as context:
            context.generate(PROMPT[:, :3], max_new_tokens=1, do_sample=False, pad_token_id=0)
        return None
    method, request, per_head = {
        "srh_heads": ("srh", {"ratio": 0.5}, 80),
        "layer_budgets": ("snapkv+error-aware", {"budget": 40}, 40),
        "compilerkv_tables": ("compilerkv", {"budget": 70}, 70),
        "kvcompose_stats": ("kvcompose", {"ratio": 0.5}, 80),
        "distilled_scorer": ("distilled", {"ratio": 0.5}, 80),
    }[kind]
    with kvruntime.compress(model(), method, artifacts=[path], **request) as session:
        session.prefill(PROMPT)
    return sum(session.report.entries_per_layer), per_head * 4 * 2  # 4 layers x 2 KV heads


def split(data: bytes) -> tuple[dict, bytes]:
    """A safetensors file's JSON header and the bytes after it."""
    size = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def join(header: object, body: bytes, declared: int | None = None) -> bytes:
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded) if declared is None else declared) + encoded + body


def check_loader(folder: str, data: bytes) -> None:
    """Both entry points give a valid artifact or a KVRuntimeError; anything else fails the test."""
    path = Path(folder) / "fuzzed.safetensors"
    path.write_bytes(data)
    for load in (read_artifact, lambda p: load_artifact(p, model=model())):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                artifact = load(path)
        except KVRuntimeError as exc:
            assert str(exc).strip() and "\n" not in str(exc).strip(), repr(exc)
            continue
        assert_valid(artifact)


def assert_valid(artifact: Artifact) -> None:
    assert artifact.kind in KNOWN_KINDS
    assert isinstance(artifact.model, ModelFingerprint)
    for field in dataclasses.fields(ModelFingerprint):
        value = getattr(artifact.model, field.name)
        assert type(value).__name__ == getattr(field.type, "__name__", field.type), (field.name, value)
    assert isinstance(artifact.provenance, dict) and isinstance(artifact.params, dict)
    assert all(isinstance(t, torch.Tensor) for t in artifact.tensors.values())


KINDS = st.sampled_from(sorted(valid_tensors()))


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes_are_refused_cleanly(data):
    with tempfile.TemporaryDirectory() as folder:
        check_loader(folder, data)


@FUZZ
@given(st.binary(max_size=512), st.integers(0, 2**64 - 1))
def test_random_bytes_after_a_header_length_are_refused_cleanly(data, length):
    with tempfile.TemporaryDirectory() as folder:
        check_loader(folder, struct.pack("<Q", length) + data)


EDITS = st.lists(
    st.tuples(
        st.sampled_from(["flip", "insert", "delete", "truncate", "set"]),
        st.floats(0, 1),
        st.binary(min_size=1, max_size=8),
    ),
    min_size=1,
    max_size=4,
)


def edit_bytes(data: bytes, edits: list[tuple[str, float, bytes]]) -> bytes:
    for op, where, payload in edits:
        at = int(where * len(data))
        if op == "flip" and at < len(data):
            data = data[:at] + bytes([data[at] ^ (payload[0] or 1)]) + data[at + 1 :]
        elif op == "insert":
            data = data[:at] + payload + data[at:]
        elif op == "delete":
            data = data[:at] + data[at + len(payload) :]
        elif op == "truncate":
            data = data[:at]
        elif op == "set":
            data = data[:at] + payload + data[at + len(payload) :]
    return data


@FUZZ
@given(KINDS, EDITS)
def test_mutated_bytes_of_a_valid_artifact_are_refused_cleanly(kind, edits):
    with tempfile.TemporaryDirectory() as folder:
        check_loader(folder, edit_bytes(valid_bytes(kind), edits))


# -- header mutations ------------------------------------------------------------------------------------------

DTYPES = [
    "F16",
    "BF16",
    "F32",
    "F64",
    "I8",
    "I16",
    "I32",
    "I64",
    "U8",
    "U16",
    "U32",
    "U64",
    "BOOL",
    "F8_E4M3",
    "F8_E5M2",
    "F8_E8M0",
    "F4",
    "F6_E2M3",
    "C64",
    "E8",
    "f32",
    "",
    "F32 ",
]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6,
)
INTS = st.integers(-3, 40) | st.sampled_from([2**31, 2**32 + 1, 2**53, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63)])


def model_json(draw) -> str:
    """The fingerprint JSON with a key dropped, a value of the wrong type, or not JSON at all."""
    fingerprint = model_fingerprint(model()).to_dict()
    how = draw(st.sampled_from(["drop", "retype", "stringify", "extra", "not_json", "other_json", "deep"]))
    key = draw(st.sampled_from(sorted(fingerprint)))
    if how == "drop":
        del fingerprint[key]
    elif how == "retype":
        fingerprint[key] = draw(JSON_VALUES)
    elif how == "stringify":
        fingerprint[key] = str(fingerprint[key])
    elif how == "extra":
        fingerprint[draw(st.text(max_size=5))] = draw(JSON_VALUES)
    elif how == "not_json":
        return draw(st.text(max_size=20))
    elif how == "other_json":
        return json.dumps(draw(JSON_VALUES))
    elif how == "deep":
        return "[" * 100_000 + "]" * 100_000
    return json.dumps(fingerprint)


def header_of(draw) -> tuple[dict, dict, bytes]:
    """The header, its metadata and the data of a valid artifact of a drawn kind."""
    header, body = split(valid_bytes(draw(KINDS)))
    return header, header["__metadata__"], body


@st.composite
def mutated_metadata(draw) -> bytes:
    """Valid safetensors whose kvcompile metadata has values changed, dropped or of the wrong type."""
    header, metadata, body = header_of(draw)
    for _ in range(draw(st.integers(1, 3))):
        what = draw(st.sampled_from(["value", "value", "model", "model", "drop", "retype", "add"]))
        key = draw(st.sampled_from(["format", "format_version", "kind", "model", "provenance", "params", "checksum"]))
        if what == "value":
            metadata[key] = draw(
                st.sampled_from(["", "0", "2", "1.0", " 1", "unknown", "srh_heads", "null", "[]", "{", "1e999", "NaN"])
                | st.text(max_size=12)
                | JSON_VALUES.map(json.dumps)
            )
        elif what == "model":
            metadata["model"] = model_json(draw)
        elif what == "drop":
            metadata.pop(key, None)
        elif what == "retype":  # safetensors metadata values must be strings
            metadata[key] = draw(JSON_VALUES)
        else:
            metadata[draw(st.text(max_size=6))] = draw(st.text(max_size=6))
    return join(header, body)


def redeclared(draw, entry: dict, body: bytes) -> dict:
    """Another dtype and shape for the same bytes (so that safetensors accepts it)."""
    start, end = entry["data_offsets"]
    sizes = {
        "F64": 8,
        "I64": 8,
        "F32": 4,
        "I32": 4,
        "F16": 2,
        "BF16": 2,
        "U8": 1,
        "BOOL": 1,
        "F8_E4M3": 1,
        "F8_E5M2": 1,
    }
    dtype = draw(st.sampled_from(sorted(d for d, size in sizes.items() if (end - start) % size == 0)))
    count = (end - start) // sizes[dtype]
    shape = draw(st.sampled_from([[count], [1, count], [count, 1]] + ([[2, count // 2]] if count % 2 == 0 else [])))
    if dtype == "BOOL" and any(b > 1 for b in body[start:end]):
        dtype = "U8"  # safetensors refuses bytes other than 0 and 1 for BOOL
    return {**entry, "dtype": dtype, "shape": shape}


@st.composite
def mutated_tensor_entries(draw) -> bytes:
    """The tensor entries of the header changed: dtype, shape and offsets that do or do not fit the bytes, tensors
    added or dropped, the header length wrong, or a header that is not an object; the checksum may be recomputed."""
    header, metadata, body = header_of(draw)
    name = draw(st.sampled_from(sorted(n for n in header if n != "__metadata__")))
    original = dict(header[name])
    declared = None
    for _ in range(draw(st.integers(1, 2))):
        what = draw(
            st.sampled_from(
                ["dtype", "shape", "offsets", "redeclare", "redeclare", "add", "drop", "length", "not_object"]
            )
        )
        entry = header.setdefault(name, {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]})
        if what == "dtype":
            entry["dtype"] = draw(st.sampled_from(DTYPES) | st.text(max_size=6))
        elif what == "shape":
            entry["shape"] = draw(st.lists(INTS, max_size=4) | JSON_VALUES)
        elif what == "offsets":
            entry["data_offsets"] = draw(st.lists(INTS, min_size=0, max_size=3) | JSON_VALUES)
        elif what == "redeclare":
            header[name] = redeclared(draw, original, body)
        elif what == "add":
            header[draw(st.text(max_size=6))] = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
        elif what == "drop":
            header.pop(name, None)
        elif what == "length":
            declared = draw(INTS.filter(lambda v: 0 <= v < 2**64))
        elif what == "not_object":
            return join(draw(JSON_VALUES), body, declared)
    if draw(st.booleans()):  # make the checksum fit whatever safetensors reads now, to get past it
        try:
            metadata["checksum"] = tensors_checksum(safetensors.torch.load(join(header, body)))
        except Exception:  # noqa: BLE001 - the file is no valid safetensors any more: nothing to fit
            pass
    return join(header, body, declared)


@FUZZ
@given(mutated_metadata())
def test_mutated_metadata_gives_a_valid_artifact_or_a_clean_refusal(data):
    with tempfile.TemporaryDirectory() as folder:
        check_loader(folder, data)


@FUZZ
@given(mutated_tensor_entries())
def test_mutated_tensor_entries_are_refused_cleanly(data):
    with tempfile.TemporaryDirectory() as folder:
        check_loader(folder, data)


# -- tensors of the right names but the wrong dtype or shape ------------------------------------------------------

SHAPES = st.lists(st.integers(0, 5), max_size=4)
TENSOR_DTYPES = st.sampled_from(
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    ]
)


@st.composite
def reshaped_artifacts(draw) -> tuple[str, dict[str, torch.Tensor]]:
    """A kind's valid tensors with one or two replaced by random values of another dtype or shape, or removed."""
    kind = draw(KINDS)
    tensors = dict(valid_tensors()[kind])
    for _ in range(draw(st.integers(1, 2))):
        name = draw(st.sampled_from(sorted(tensors) or ["x"]))
        if draw(st.booleans()) and tensors:
            tensors.pop(name, None)
            continue
        shape = draw(SHAPES | st.just(list(tensors.get(name, torch.zeros(1)).shape)))
        values = torch.rand(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 9))))
        values = values * draw(st.sampled_from([2.0, 1.0, -1.0, 0.0]))
        tensors[name] = values.to(draw(TENSOR_DTYPES))
    return kind, tensors


@FUZZ
@given(reshaped_artifacts())
def test_a_valid_artifact_with_wrong_tensors_is_refused_by_the_loader_or_works(case):
    kind, tensors = case
    with tempfile.TemporaryDirectory() as folder:
        try:
            path = save_artifact(artifact_of(kind, tensors), Path(folder) / f"{kind}.safetensors")
            held = use(path, kind)
        except KVRuntimeError:
            return
        # Accepted: it is read back as written, and a method built on it holds exactly what was asked for.
        for name, tensor in read_artifact(path).tensors.items():
            assert torch.equal(tensor, tensors[name]), name
        if held is not None:
            assert held[0] == held[1], held


def test_the_fuzzer_covers_every_artifact_kind():
    assert sorted(valid_tensors()) == sorted(KNOWN_KINDS)


def test_the_valid_artifacts_of_every_kind_load_and_work():
    with tempfile.TemporaryDirectory() as folder:
        for kind in sorted(valid_tensors()):
            path = Path(folder) / f"{kind}.safetensors"
            path.write_bytes(valid_bytes(kind))
            held = use(path, kind)
            assert held is None or held[0] == held[1], (kind, held)


# -- what the fuzzing found, and the per-kind tensor check, as plain tests ----------------------------------------


def rewritten(path: Path, **metadata: str) -> Path:
    _rewrite_metadata(path, **metadata)
    return path


FINGERPRINT = model_fingerprint(model()).to_dict()


@pytest.mark.parametrize(
    "metadata, message",
    [
        (
            {"model": json.dumps({**FINGERPRINT, "num_layers": "4"})},
            "fingerprint num_layers is '4', not a positive integer",
        ),
        (
            {"model": json.dumps({**FINGERPRINT, "architecture": None})},
            "fingerprint architecture is None, not a non-empty",
        ),
        ({"model": "[" * 100_000 + "]" * 100_000}, "malformed kvcompile metadata (maximum recursion depth exceeded"),
        ({"params": "[1, 2]"}, "malformed kvcompile metadata (params is a JSON list, not an object)"),
        ({"kind": "mystery"}, "unknown artifact kind 'mystery' (known: srh_heads, layer_budgets,"),
    ],
)
def test_malformed_metadata_found_by_fuzzing_is_an_artifact_error(tmp_path, metadata, message):
    path = rewritten(save_artifact(artifact_of("srh_heads"), tmp_path / "a.safetensors"), **metadata)
    with pytest.raises(KVRuntimeError) as refused:
        read_artifact(path)
    assert message in str(refused.value)


def test_a_nan_in_a_float8_tensor_is_an_artifact_error_not_a_torch_error(tmp_path):
    tensors = {**valid_tensors()["srh_heads"], "extra": torch.tensor([1.0, float("nan")]).to(torch.float8_e4m3fn)}
    with pytest.raises(KVRuntimeError, match="tensor 'extra' holds NaN or infinite values"):
        save_artifact(artifact_of("srh_heads", tensors), tmp_path / "a.safetensors")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "kind, change, message",
    [
        ("srh_heads", {"srh_score": None}, "srh_heads tensor 'srh_score' is missing"),
        (
            "srh_heads",
            {"srh_score": torch.rand(3, 4)},
            "'srh_score' has shape [3, 4], expected [layers=4, query_heads=4]",
        ),
        (
            "layer_budgets",
            {"layer_error": torch.tensor([True, False, True, True])},
            "'layer_error' is bool, expected numeric values",
        ),
        (
            "compilerkv_tables",
            {"budgets": torch.tensor([70.0, 100.0])},
            "'budgets' is float32, expected integer values",
        ),
        ("layer_budgets", {"layer_error": torch.zeros(4)}, "'layer_error' must be non-negative with a positive sum"),
        (
            "compilerkv_tables",
            {"budgets": torch.tensor([70, 100, 130])},
            "'head_reliability' has shape [2, 4, 4], expected [budgets=3, layers=4, query_heads=4]",
        ),
        (
            "compilerkv_tables",
            {"entropy_edges": torch.tensor([1.0, 2.0, 3.0])},
            "'entropy_edges' has shape [3], expected [entropy_bins-1=2]",
        ),
        (
            "kvcompose_stats",
            {"head_fractions": torch.full((3, 4, 3), 0.5)},
            "'head_fractions' has shape [3, 4, 3], expected [ratios=3, layers=4, kv_heads=2]",
        ),
        ("kvcompose_stats", {"ratios": torch.zeros(0)}, "'ratios' has shape [0], expected [ratios]"),
        ("tuned_defaults", {"full_accuracy": torch.tensor(0.9)}, "'full_accuracy' has shape [], expected [1]"),
    ],
)
def test_a_kind_without_the_tensors_the_runtime_reads_is_refused_naming_the_tensor(tmp_path, kind, change, message):
    tensors = {**valid_tensors()[kind], **change}
    tensors = {name: tensor for name, tensor in tensors.items() if tensor is not None}
    path = save_artifact(artifact_of(kind, tensors), tmp_path / "a.safetensors")
    assert read_artifact(path).kind == kind  # the file itself is sound: `kvcompile info` shows it
    with pytest.raises(KVRuntimeError) as refused:
        load_artifact(path, model=model())
    assert message in str(refused.value) and str(refused.value).startswith(str(path))


@pytest.mark.parametrize(
    "ratios",
    [torch.tensor(0.5), torch.tensor([1, 2]), torch.tensor([0.25, 1.5])],
    ids=["a number", "integers", "above 1"],
)
def test_a_scorers_share_ratios_that_are_not_ratios_are_refused_in_one_line(ratios):
    """Found by the fuzzer: a scorer's optional share ratios as one number crashed the reader with a TypeError."""
    tensors = {**valid_tensors()["distilled_scorer"], "share_ratios": ratios}
    with tempfile.TemporaryDirectory() as folder:
        path = save_artifact(artifact_of("distilled_scorer", tensors), Path(folder) / "s.safetensors")
        with pytest.raises(KVRuntimeError, match=r"share_ratios must be a list of ratios in \(0, 1\), got torch\."):
            use(path, "distilled_scorer")
