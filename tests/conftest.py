"""Fixtures: tiny randomly initialised Llama, Qwen2 (and Qwen3, by name) models built in code (no download), and the
real default model for the few integration tests, from the tests' own cache."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import settings

import kvruntime
import kvruntime.models.model_loading
from kvruntime.methods.distilled import feature_count
from kvruntime.plumbing.cache_ops import hooked_cache

# The tests' own cache of the dequantised default model and of locks (the tests and the processes they start), not
# the user's: a test never shares or damages what `make demo` uses. A cache named by the caller (CI's) is kept.
os.environ.setdefault("KVCOMPILE_CACHE", str(Path.home() / ".cache" / "kvcompile-tests"))
# datasets' Arrow files and matplotlib's font list go there too (both read these at their import, after this), for
# the tests and the processes they start: `pytest_sessionfinish` fails a run that wrote the user's Hugging Face cache.
TESTS_CACHE = Path(os.environ["KVCOMPILE_CACHE"])
os.environ.setdefault("HF_DATASETS_CACHE", str(TESTS_CACHE / "hf-datasets"))
os.environ.setdefault("MPLCONFIGDIR", str(TESTS_CACHE / "matplotlib"))
USER_HF_CACHE = Path.home() / ".cache" / "huggingface"
# `make test` runs two pytest-xdist workers (CI has two cores): each worker and the processes it starts use one thread,
# as two workers of two threads each on two cores would wait on each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
# Every run replays the same examples (a failure is one a rerun reproduces); KVCOMPILE_FUZZ_SEARCH=1 searches anew.
settings.register_profile("replay", derandomize=True, database=None)
settings.load_profile("default" if os.environ.get("KVCOMPILE_FUZZ_SEARCH") else "replay")

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


HEAD_DIM = TINY["hidden_size"] // TINY["num_attention_heads"]
# Sliding windows shorter than the tests' prompts (80 tokens): the band is exercised.
HYBRID = dict(head_dim=HEAD_DIM, sliding_window=16, query_pre_attn_scalar=HEAD_DIM, pad_token_id=0)
# kind -> (config class, model class, settings beside TINY): decoders transformers runs through its attention
# interface, each doing something of its own to its queries (or its cache).
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=HEAD_DIM)),  # per-head q/k norms before RoPE
    # Hybrid: sliding-window layers between full-attention ones, per-head norms, a query scalar.
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        **HYBRID, "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]}),
    # Hybrid, three sliding layers to one full, q/k norms over the whole projection.
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {**HYBRID, "layer_types": [
        "sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),  # one fused qkv projection
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(pad_token_id=0)),  # q/k norms over the whole projection
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(attention_multiplier=0.3)),  # its own query scaling
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(pad_token_id=0)),  # some layers without RoPE
    # Hybrid (sliding and global layers alternate), attention logits soft-capped: eager attention, no sdpa. Weights
    # large enough for logits of a few units, where a cap of 2 bends them (at the default scale it would not).
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**HYBRID, "attn_logit_softcapping": 2.0, "initializer_range": 0.2}),
    # Hybrid (sliding and full layers alternate), a learned sink logit per query head in every softmax: eager
    # attention, no sdpa; a mixture of experts.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {**HYBRID, "num_local_experts": 2, "num_experts_per_tok": 2,
                "layer_types": ["sliding_attention", "full_attention"] * 2}),
}  # fmt: skip


def tiny_model(kind: str, seed: int = 0) -> torch.nn.Module:
    if kind not in ARCHITECTURES:
        raise ValueError(kind)
    config_class, model_class, settings = ARCHITECTURES[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**TINY, **settings})
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for module in model.modules():  # learned attention sinks large enough to take a share of each query's weight
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_(0.0, 2.0)
    model.config.architectures = [type(model).__name__]
    return model.eval()


def gemma_marks() -> list[pytest.MarkDecorator]:
    """A test of the second shipped model (Gemma 3 270M) is `integration` and `gemma` (`make test-gemma` installs
    its packages and runs these), skipped where its packages are not installed, except where
    `KVCOMPILE_REQUIRE_GEMMA` is set (`make test-gemma`, CI): there a missing package fails them, not skips."""
    from kvruntime.models.default_model import SHIPPED_MODELS

    missing = importlib.util.find_spec(SHIPPED_MODELS["gemma-3-270m"].package) is None
    skip = pytest.mark.skipif(
        missing and not os.environ.get("KVCOMPILE_REQUIRE_GEMMA"),
        reason="gemma-3-270m's packages are not installed (`make test-gemma` installs them)",
    )
    return [pytest.mark.integration, pytest.mark.gemma, skip]


def needs_gemma(test: object) -> object:
    """`gemma_marks` on a test function."""
    for mark in gemma_marks():
        test = mark(test)
    return test


def import_kvpress() -> object:
    """kvpress, for the tests of its presses: skipped where it is not installed (the main venv), except where
    `KVCOMPILE_REQUIRE_KVPRESS` is set (`make test-bench`): there a missing kvpress fails, not skips."""
    if os.environ.get("KVCOMPILE_REQUIRE_KVPRESS"):
        with warnings.catch_warnings():  # as importorskip: kvpress's dependency fire imports the deprecated pipes
            warnings.simplefilter("ignore", DeprecationWarning)
            return importlib.import_module("kvpress")
    return pytest.importorskip("kvpress")


def save_char_tokenizer(folder) -> None:
    """A tokenizer of one token per printable ASCII character (ids 1-95, 0 for anything else), saved as a model
    folder's tokenizer files: what a tiny model needs to load from a folder like any checkpoint."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    characters = {chr(code): code - 31 for code in range(32, 127)}
    tokenizer = Tokenizer(models.BPE({"[UNK]": 0, **characters}, merges=[], unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(folder)


def place_in_hub_cache(folder, cache, repo_id: str):
    """`folder` as huggingface_hub caches a downloaded repo: a snapshot named by a commit, and the ref `main`."""
    import shutil
    from pathlib import Path

    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    commit = "0" * 40
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


class CharTokenizer:
    """A tokenizer for tiny models: one token per character."""

    pad_token_id, eos_token_id = 0, None

    def __call__(self, text: str, add_special_tokens: bool = False):
        return type("Encoding", (), {"input_ids": [3 + ord(c) % 90 for c in text]})()


@pytest.fixture(params=["llama", "qwen2"])
def tiny(request: pytest.FixtureRequest) -> torch.nn.Module:
    return tiny_model(request.param)


@pytest.fixture
def tokens() -> torch.Tensor:
    """A prompt of 80 random tokens, batch size 1."""
    return torch.randint(3, TINY["vocab_size"], (1, 80), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def short_cql_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvcompile tables`' CQL fits in 200 gradient steps, not 2000, in this process: for tests of what the command
    runs and writes, not of the fit (test_compilerkv_compile's)."""
    from kvcompile.recipes.compilerkv import tables

    fit = tables.fit_greedy_table
    shorter = lambda *args: fit(*args[:-1], dataclasses.replace(args[-1], steps=200))  # noqa: E731
    monkeypatch.setattr(tables, "fit_greedy_table", shorter)


@pytest.fixture(scope="session")
def default_model():
    return kvruntime.load_model()


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    """Every path under `folder` with its modification time and size (empty when there is no folder)."""
    if not folder.is_dir():
        return {}
    return {str(p): (p.lstat().st_mtime_ns, p.lstat().st_size) for p in folder.rglob("*")}


def pytest_sessionstart(session: pytest.Session) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the run's controller (or a run without workers) checks it
        session.config.stash[_HF_LISTING] = _listing(USER_HF_CACHE)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A run that wrote into the user's Hugging Face cache fails, naming what it wrote."""
    before = session.config.stash.get(_HF_LISTING, None)
    if before is None:
        return
    after = _listing(USER_HF_CACHE)
    written = sorted(path for path, stamp in after.items() if before.get(path) != stamp)
    if written:
        print(
            f"\nthe tests wrote into {USER_HF_CACHE}: {', '.join(written[:5])}" + (" ..." if len(written) > 5 else "")
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_HF_LISTING = pytest.StashKey[dict]()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test on the real default model is marked `integration` (so `-m "not integration"` is the fast unit run)."""
    unmarked = [
        item.nodeid
        for item in items
        if "default_model" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("integration")
    ]
    if unmarked:
        raise pytest.UsageError(f"tests on the real default model not marked integration: {', '.join(unmarked)}")


@pytest.fixture(autouse=True)
def real_model_only_in_integration_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for a test that loads a shipped (or GGUF) model itself: outside an `integration` test, loading fails
    it."""
    if request.node.get_closest_marker("integration"):
        return

    def refuse(*args, **kwargs):
        pytest.fail("this test loads the real default model: mark it integration")

    monkeypatch.setattr(kvruntime.models.model_loading, "load_shipped_model", refuse)
    monkeypatch.setattr(kvruntime.models.model_loading, "load_gguf_model", refuse)


def dynamic_layer_shares(model: torch.nn.Module, prompts: list[tuple[int, torch.Tensor]], ratio: float) -> torch.Tensor:
    """kvcompose's dynamic allocation on each prompt, as shares of the prompt, averaged over the prompts: [L]."""
    shares = []
    for _, ids in prompts:
        with kvruntime.compress(model, "kvcompose", ratio=ratio, options={"mode": "dynamic"}) as session:
            session.prefill(ids)
        shares.append(torch.tensor(session.report.slots_per_layer, dtype=torch.float64) / ids.shape[1])
    return torch.stack(shares).mean(dim=0)


def scorer_that_prefers(
    model: torch.nn.Module, feature: int, sign: float = 1.0, oracle: str = "test"
) -> kvruntime.Artifact:
    """A scorer whose score is one feature (per KV head): a reference the selection must follow exactly. Its
    compiled layer shares (the default allocation's) grow with the layer, the same at every ratio."""
    fingerprint = kvruntime.model_fingerprint(model)
    weights = torch.zeros(fingerprint.num_layers, feature_count(model.config.hidden_size), fingerprint.num_kv_heads)
    weights[:, feature] = sign
    shares = torch.arange(1.0, fingerprint.num_layers + 1)
    tensors = {
        "weights": weights,
        "share_ratios": torch.tensor([0.25, 0.5, 0.75, 0.9]),
        "layer_shares": (shares / shares.sum()).expand(4, -1).clone(),
    }
    return kvruntime.Artifact("distilled_scorer", tensors, fingerprint, {}, {"oracle": oracle})


def compiled_artifacts(
    model: torch.nn.Module, folder: Path, ratios: tuple[float, ...], prompt_tokens: int
) -> list[Path]:
    """Artifacts of every kind a method applies, for a tiny model: SRH head scores, very uneven layer errors (some
    layers' error-aware budgets then exceed the context at small ratios), KVCompose statistics compiled for
    `ratios` on a synthetic corpus, and a distilled scorer (one feature; its oracle, reconstruction, replayable)."""
    from kvcompile.calibration.corpus import Corpus
    from kvcompile.calibration.job import CompileJob
    from kvcompile.recipes.kvcompose.attention_stats import compile_attention_stats
    from kvcompile.recipes.kvcompose.settings import StatsSettings

    corpus = Corpus(
        "synthetic", tuple("".join(chr(97 + (i * 7 + j * j * 13) % 26) for j in range(8000)) for i in range(3))
    )
    common = dict(model=kvruntime.model_fingerprint(model), provenance={"command": "test"})
    errors = torch.tensor([0.02, 0.9, 0.03, 0.05])
    heads = torch.rand(4, 4, generator=torch.Generator().manual_seed(1))
    settings = StatsSettings(ratios=ratios, prompts=3, prompt_tokens=prompt_tokens)
    stats = compile_attention_stats(CompileJob(model, CharTokenizer(), folder / "stats.safetensors"), corpus, settings)
    return [
        kvruntime.save_artifact(
            kvruntime.Artifact("srh_heads", {"srh_score": heads}, **common), folder / "srh.safetensors"
        ),
        kvruntime.save_artifact(
            kvruntime.Artifact("layer_budgets", {"layer_error": errors}, **common), folder / "budgets.safetensors"
        ),
        kvruntime.save_artifact(stats, folder / "stats.safetensors"),
        kvruntime.save_artifact(
            scorer_that_prefers(model, feature=5, oracle="reconstruction"), folder / "scorer.safetensors"
        ),
    ]


class LargestCache:
    """The test's own count of the largest KV cache held after any attention layer of a prefill ran (passes of more
    than one token: decoding then adds a token per step to whatever the prefill kept)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.largest = 0
        self.handles = [
            m.register_forward_hook(self.seen, with_kwargs=True) for m in model.modules() if hasattr(m, "q_proj")
        ]

    def seen(self, module, args, kwargs, output) -> None:
        if kwargs["hidden_states"].shape[1] == 1:
            return
        cache = hooked_cache(kwargs)
        held = sum(layer.keys.untyped_storage().nbytes() * 2 for layer in cache.layers if layer.is_initialized)
        self.largest = max(self.largest, held)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
