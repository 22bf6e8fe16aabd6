"""Fixtures: tiny randomly initialised Llama and Qwen2 models built in code (no download), and the real default
model for the few integration tests."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def tiny_model(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**TINY))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY))
    else:
        raise ValueError(kind)
    model.config.architectures = [type(model).__name__]
    return model.eval()


@pytest.fixture(params=["llama", "qwen2"])
def tiny(request: pytest.FixtureRequest) -> torch.nn.Module:
    return tiny_model(request.param)


@pytest.fixture
def tokens() -> torch.Tensor:
    """A prompt of 80 random tokens, batch size 1."""
    return torch.randint(3, TINY["vocab_size"], (1, 80), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="session")
def default_model():
    import kvruntime

    return kvruntime.load_model()
