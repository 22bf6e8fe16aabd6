"""What a compression method is to the engine.

Every method sees each attention layer once at the end of prefill (`layer_statistics`) and then, once the whole
model has run, turns what it gathered and the request (ratio or budget) into a `Selection`: a score per (KV head,
token) in every layer and how many entries each (layer, KV head) keeps. Most methods score tokens by window
attention layer by layer (`ScoringMethod`); a method that needs every layer's statistics at once (CompilerKV's
global attention mass) does its work in `select`, and a method that scores with a second pass over the prompt
(KVCompose's dynamic mode) asks the `PrefillResult` for it there.

A method whose layer budgets are known before any layer has run (`layer_budgets`: uniform, compiled or error-aware
shares) lets the engine cut each layer right after its attention, inside the prefill, and stream a long prompt in
chunks (`stream_scores`): the cache held then never exceeds the budgets plus one chunk in one layer.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..errors import KVRuntimeError
from ..math.attention_logits import AttentionLogits
from ..math.selection import protect_window
from ..plumbing.window import window_attention
from ..requests.request import KeepPlan, Request
from ..requests.serving import check_chunk_size


@dataclasses.dataclass
class PrefillResult:
    """What the engine knows about the prefill when the method selects: the prompt, the model's final hidden
    states (after the last norm), from which the window's next-token log-probabilities can be had, and a second
    pass over the prompt on request."""

    length: int  # tokens of the prompt
    num_kv_heads: int
    input_ids: torch.Tensor | None  # [B, N]
    hidden_states: torch.Tensor  # [B, N, hidden]
    output_logits: Callable[[torch.Tensor], torch.Tensor]  # final hidden states -> logits, as the model's forward
    # Feeds the prompt again after itself (after the token ids `prefix`) in the filled cache: per layer, each
    # token's largest `target` score from the copy [B, Hq, N] (`kvruntime.plumbing.second_pass`: attention, or kvzip_plus).
    # Costs a second prefill: only methods that score this way call it.
    second_pass_attention: Callable[..., list[torch.Tensor]]
    # Feeds input embeddings [n, hidden] (learned lookahead queries) after the prompt in the filled cache: per layer,
    # each token's mean attention from them [B, Hq, N] (`kvruntime.plumbing.second_pass.lookahead_attention`). Costs n tokens.
    lookahead_attention: Callable[[torch.Tensor], list[torch.Tensor]]

    def token_logprobs(self, last: int) -> torch.Tensor:
        """log p(x_j | x_<j) of the last `last` prompt tokens (teacher-forced, from the prefill): [B, last]."""
        if self.input_ids is None:
            raise ValueError("the prefill was given embeddings, not token ids: token log-probabilities are unknown")
        last = min(last, self.input_ids.shape[1] - 1)
        logits = self.output_logits(self.hidden_states[:, -last - 1 : -1])
        return logits.log_softmax(dim=-1).gather(-1, self.input_ids[:, -last:, None]).squeeze(-1)


@dataclasses.dataclass(frozen=True)
class LayerInputs:
    """What the engine hands a method from one attention layer at the end of prefill."""

    index: int  # the layer's index
    queries: torch.Tensor  # the window's queries [B, Hq, w, D], post-RoPE
    keys: torch.Tensor  # the layer's cached keys [B, Hkv, N, D], post-RoPE
    values: torch.Tensor  # the layer's cached values [B, Hkv, N, D]
    logits: AttentionLogits  # how the attention makes query-key products into logits
    hidden_states: torch.Tensor  # the attention's input [B, N, hidden], after the layer's input norm
    # Chunked prefill: the position of the first token of `hidden_states` and `queries`' chunk (keys hold the entries
    # kept from the earlier chunks, then the chunk's own), and whether it is the prompt's last chunk.
    start: int = 0
    final: bool = True
    plan: KeepPlan | None = None  # what the prompt keeps (its ids among it)


@dataclasses.dataclass
class Selection:
    """Scores [B, Hkv, N] per layer (higher is kept first) and entries kept per (layer, KV head) [L, Hkv];
    `notes` are lines for the compression report (what the method decided and why)."""

    scores: list[torch.Tensor]
    counts: torch.Tensor
    notes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Method(abc.ABC):
    """Subclasses set `name` and `window` (the prompt's last `window` queries are rebuilt in every layer and
    always stay)."""

    name: ClassVar[str]
    window: int = 32
    merge: str = "off"  # what becomes of the evicted entries (`kvruntime.math.merging`)

    def check_request(self, request: Request) -> None:
        """Refuse a request this method cannot serve, before any model work (default: any ratio or budget)."""

    @property
    def budgets_known_in_advance(self) -> bool:
        """Whether `layer_budgets` can say what each layer keeps before any layer's scores are known."""
        return False

    def layer_budgets(self, num_layers: int, plan: KeepPlan) -> list[int]:
        """Tokens each layer keeps from the prompt (every KV head of a layer the same number: composite tokens), from
        the keep plan and compiled data alone (only when `budgets_known_in_advance`)."""
        raise KVRuntimeError(f"{self.name}'s layer budgets need every layer's scores: they are not known in advance")

    def budgets_note(self, plan: KeepPlan) -> str | None:
        """How `layer_budgets` decided, for the compression report (None: the counts say it all)."""
        return None

    def stream_scores(self, layer: LayerInputs, held: torch.Tensor | None, carry: Any) -> tuple[torch.Tensor, Any]:
        """Scores [B, Hkv, held + new] of every entry layer `layer` holds once a chunk of the prompt went in (the
        entries kept from earlier chunks, then the chunk's; the whole prompt is one chunk when it is not streamed).
        `held`: the scores the kept entries had (None on the first chunk); `carry`: what this method carried from
        the layer's previous chunk. Returns the scores and the carry for the next chunk. The scores protect the
        prompt's last `window` tokens on the final chunk. Default: the window's scores over all entries held."""
        return self.layer_statistics(layer), None

    def required_memory(self) -> str | None:
        """The memory mode this method's per-head counts need (None: either)."""
        return None

    def rescores_whole_prompt(self, plan: KeepPlan) -> bool:
        """Whether, given this prompt in one piece, this method's scores gain from a look at all of it after the
        prefill (its `appended_queries`): its layers are then held whole until `select`, even with budgets known in
        advance; streamed in chunks, they are cut inside the prefill on `stream_scores` alone."""
        return False

    @property
    def appended_queries(self) -> torch.Tensor | None:
        """Input embeddings [n, hidden] (learned lookahead queries) whose attention over a prompt given in one piece
        this method may read in `select` (`PrefillResult.lookahead_attention`): the engine feeds them inside the
        prefill of each prompt `rescores_whole_prompt` takes, where it can. None: no such queries."""
        return None

    def reads_token_ids(self) -> str | None:
        """What of this method reads the prompt's token ids (None: nothing): a prompt given as embeddings has none,
        and is refused rather than served without them."""
        return None

    def with_layer_budgets(self, layer_error: torch.Tensor) -> Method | None:
        """This method with error-aware layer budgets from per-layer errors [L] (`<name>+error-aware`), where it applies
        them itself; None: a scoring method gets them from `layer_budgets.WithLayerBudgets`."""
        return None

    @abc.abstractmethod
    def layer_statistics(self, layer: LayerInputs) -> Any:
        """What the method keeps from one layer at the end of prefill."""

    @abc.abstractmethod
    def select(self, statistics: list[Any], plan: KeepPlan, prefill: PrefillResult) -> Selection:
        """Turn every layer's statistics into a selection that serves the keep plan on this prompt: on average at
        most `plan.keep` entries per (layer, KV head)."""


@dataclasses.dataclass
class ScoringMethod(Method):
    """A method that scores tokens from each layer's window attention on its own. Subclasses implement
    `token_scores`; override `layer_budgets` to move budget between layers (default: the same number everywhere),
    or `head_counts` to decide from every layer's scores (then its registration's `streams` is False). Streamed in
    chunks, each chunk's last `window` queries score everything the layer holds (as chunked SnapKV variants do)."""

    @abc.abstractmethod
    def token_scores(self, attention: torch.Tensor, layer: int) -> torch.Tensor:
        """Window attention [B, Hkv, G, w, N] of layer `layer` -> scores [B, Hkv, N]."""

    def window_scores(
        self, queries: torch.Tensor, keys: torch.Tensor, logits: AttentionLogits, layer: int
    ) -> torch.Tensor:
        """Token scores [B, Hkv, N] from the window's queries [B, Hq, w, D]; the window itself always stays."""
        return protect_window(self.token_scores(window_attention(queries, keys, logits), layer), queries.shape[2])

    def layer_statistics(self, layer: LayerInputs) -> torch.Tensor:
        return self.window_scores(layer.queries, layer.keys, layer.logits, layer.index)

    @property
    def budgets_known_in_advance(self) -> bool:
        return True

    def layer_budgets(self, num_layers: int, plan: KeepPlan) -> list[int]:
        return [plan.keep] * num_layers

    def select(self, statistics: list[torch.Tensor], plan: KeepPlan, prefill: PrefillResult) -> Selection:
        return Selection(statistics, self.head_counts(statistics, plan))

    def head_counts(self, layer_scores: list[torch.Tensor], plan: KeepPlan) -> torch.Tensor:
        """Entries kept per (layer, KV head), [L, Hkv], averaging `plan.keep`. Scores already protect the window."""
        num_layers, num_kv_heads = len(layer_scores), layer_scores[0].shape[1]
        budgets = self.layer_budgets(num_layers, plan)
        return torch.tensor(budgets)[:, None].expand(num_layers, num_kv_heads).clone()


def check_prefill_chunk_size(method: Method, size: int | None) -> None:
    """Refuse a chunk size the method cannot stream with (`serving.check_chunk_size`)."""
    check_chunk_size(method.name, method.window, method.budgets_known_in_advance, size)
