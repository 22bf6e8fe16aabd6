"""Can a one-pass student close its gap to the teacher? Cheaper-than-a-second-pass levers, per text type (issue #63).

    python -m benchmarks.distilled.student_features [--train-prompts 16] [--tokens-per-prompt 1024] [--prompts 5]

The student ranks each KV head's tokens; what it should keep is what the teacher (the second pass it was distilled
from) ranks first. Measure: the teacher's score mass the student's top-k holds, over the mass of the teacher's own
top-k (1 for the teacher), per (layer, KV head), k the tokens a head keeps at 0.5, 0.75 and 0.9 (the first token and
the last 16 are kept by both and left out). Per text type, on held-out prompts no compile command reads (Moby-Dick,
Jekyll and Hyde, Python source, the Python language reference: `calibration_data/held_out/`), each variant paired with
the ridge student refitted on the same tokens (its mean difference and 95% bootstrap interval over prompts).

Variants, each per (layer, KV head) on the same sample of calibration tokens (`austen-repeats`, as `kvcompile
distill` reads), the ridge strength chosen on its last tenth:
- `ridge`: the shipped student's fit (a token's attention input, position, first token, likeness to the earlier ones);
- `ridge, teacher's top weighted`: each token's squared error weighted by the teacher's score (its softmax times the
  length, clamped to 0.2-20): the fit spends itself on the top of the ranking, where the cut is;
- `ridge + previous token`: the previous token's attention input beside (reading a copy, the teacher's query for a
  token is its predecessor's);
- `ridge + attention received`: the log of the largest attention the token gets from any later query of the prefill
  itself (the whole causal attention, a non-local feature one pass holds; max over the KV head's query heads, mean,
  plus the layer's mean, as the teacher's scores are pooled);
- `ridge + Compactor's two terms`: that attention and the log leverage of the token's key among the layer's keys
  beside (the two terms Compactor blends, each exact here, the ridge choosing their weights per head).
The shipped scorer (ridge on every token of 32 prompts) is scored beside them; `student.py` measured an MLP.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

import kvruntime
from benchmarks.distilled.student import fit_ridge
from benchmarks.reporting import markdown_table, run_header, write_results
from kvcompile.calibration.corpus import REPEATING_CORPUS, Corpus, calibration_prompts, load_corpus
from kvcompile.evaluation.metrics import bootstrap_interval
from kvcompile.recipe import default_artifact
from kvcompile.recipes.distilled.distill import prompt_features_and_targets
from kvcompile.tasks.real_text import held_out_text
from kvruntime.math.composite_tokens import kv_head_scores
from kvruntime.methods.distilled import DistilledScorer, oracle_targets
from kvruntime.methods.distilled.leverage import key_leverage
from kvruntime.plumbing.attention import captured_logits
from kvruntime.plumbing.window import query_hooks, window_attention
from kvruntime.requests.request import kept_per_head

RATIOS = (0.5, 0.75, 0.9)
WINDOW, SINKS = 16, 1  # the default's
BASELINE = "ridge"
# What each variant reads for one layer and KV head: the shipped features x [N, F], the previous token's states
# [N, H], the attention each token receives and its key's log leverage [Hkv, N].
LayerInputs = dict[str, torch.Tensor]
VARIANTS: dict[str, Callable[[LayerInputs, int], torch.Tensor]] = {
    "ridge": lambda layer, head: layer["x"],
    "ridge, teacher's top weighted": lambda layer, head: layer["x"],
    "ridge + previous token": lambda layer, head: torch.cat([layer["x"], layer["previous"]], dim=-1),
    "ridge + attention received": lambda layer, head: torch.cat([layer["x"], layer["received"][head, :, None]], -1),
    "ridge + Compactor's two terms": lambda layer, head: torch.cat(
        [layer["x"], layer["received"][head, :, None], layer["leverage"][head, :, None]], -1
    ),
}
WEIGHTED = "ridge, teacher's top weighted"
PER_HEAD = (
    WEIGHTED,
    "ridge + attention received",
    "ridge + Compactor's two terms",
)  # their inputs or weights differ per KV head


def attention_received_and_leverage(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two [L, Hkv, N]: per layer, the log of the largest attention each token gets from a later query of the prefill
    (pooled over query heads as the teacher's scores are), and the log leverage of its key among the layer's keys
    (Compactor's two terms, each exact here where Compactor sketches them)."""
    received: dict[int, torch.Tensor] = {}
    leverage: dict[int, torch.Tensor] = {}
    length = ids.shape[1]

    def keep(layer, module, queries, keys, values, *_):
        attention = window_attention(queries, keys, captured_logits(module))[0]  # [Hkv, g, N queries, N keys]
        later = attention.tril(diagonal=-1).amax(dim=-2)  # [Hkv, g, N]: from queries after the key only
        received[layer] = oracle_targets(kv_head_scores(later.flatten(0, 1)[None], keys.shape[1])[0]).float()
        leverage[layer] = key_leverage(keys)[0].log().float()

    with query_hooks(model, keep, window=length), torch.no_grad():
        model.base_model(input_ids=ids, use_cache=True)
    return tuple(torch.stack([terms[i] for i in sorted(terms)]) for terms in (received, leverage))


def prompt_inputs(model, tokenizer, ids: torch.Tensor, oracle: str) -> dict[str, torch.Tensor]:
    """One prompt's shipped features [L, N, F], previous-token states [L, N, H], attention received and the
    teacher's log-scores [L, Hkv, N]."""
    features, targets = prompt_features_and_targets(model, tokenizer, ids, oracle)
    x = torch.stack([f.float() for f in features])
    hidden = model.config.hidden_size
    previous = torch.cat([torch.zeros_like(x[:, :1, :hidden]), x[:, :-1, :hidden]], dim=1)
    received, leverage = attention_received_and_leverage(model, ids)
    return {"x": x, "previous": previous, "received": received, "leverage": leverage, "y": targets.float()}


def teacher_weights(log_scores: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [..., N]: the weighted variant's per-token weights, from the teacher's log-scores."""
    share = log_scores.double().softmax(dim=-1) * log_scores.shape[-1]
    return share.clamp(0.2, 20.0).sqrt()  # the roots: the rows are scaled by them, the squared error by the weights


def variant_inputs(name: str, inputs: dict[str, torch.Tensor], layer: int, head: int) -> torch.Tensor:
    return VARIANTS[name]({key: inputs[key][layer] for key in ("x", "previous", "received", "leverage")}, head)


def fit_variants(samples: list[dict[str, torch.Tensor]], layers: int) -> dict[str, list[torch.Tensor]]:
    """Each variant's weights per layer, [F', Hkv] (a column per KV head; fitted together when the variant reads the
    same features and weights for every head)."""
    fitted: dict[str, list[torch.Tensor]] = {name: [] for name in VARIANTS}
    heads = samples[0]["y"].shape[1]
    for layer in tqdm(range(layers), desc="fitting", unit="layer"):
        for name in VARIANTS:
            if name in PER_HEAD:
                fitted[name].append(torch.cat([fit_variant(samples, name, layer, head) for head in range(heads)], 1))
            else:
                fitted[name].append(fit_variant(samples, name, layer, None))
    return fitted


def fit_variant(samples: list[dict[str, torch.Tensor]], name: str, layer: int, head: int | None) -> torch.Tensor:
    """One variant's ridge weights [F', 1] for one KV head, or [F', Hkv] for all (`head` None)."""
    heads = slice(None) if head is None else slice(head, head + 1)
    x = torch.cat([variant_inputs(name, s, layer, head or 0) for s in samples]).double()
    y = torch.cat([s["y"][layer, heads].T for s in samples]).double()
    if name == WEIGHTED:  # weighted least squares: plain least squares on rows scaled by the weights' roots
        w = torch.cat([s["weights"][layer, head] for s in samples])[:, None]
        x, y = x * w, y * w
    return fit_ridge(x, y, held_out=x.shape[0] // 10)


def captured_mass(scores: torch.Tensor, log_scores: torch.Tensor, ratio: float) -> float:
    """The teacher's mass in the top-k of `scores` over its mass in its own top-k, for [Hkv, N] scores, the sinks and
    the window left out; mean over KV heads."""
    length = scores.shape[-1]
    k = kept_per_head(length, WINDOW, ratio=ratio) - WINDOW - SINKS
    scores, mass = scores[:, SINKS:-WINDOW], log_scores[:, SINKS:-WINDOW].double().exp()
    held = mass.gather(-1, scores.topk(k, dim=-1).indices).sum(-1)
    return float((held / mass.topk(k, dim=-1).values.sum(-1)).mean())


def sampled(inputs: dict[str, torch.Tensor], tokens: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    chosen = torch.randperm(inputs["x"].shape[1], generator=generator)[:tokens]
    return {
        "x": inputs["x"][:, chosen],
        "previous": inputs["previous"][:, chosen],
        "received": inputs["received"][..., chosen],
        "leverage": inputs["leverage"][..., chosen],
        "y": inputs["y"][..., chosen],
        "weights": teacher_weights(inputs["y"])[..., chosen],
    }


def held_out_texts() -> dict[str, Corpus]:
    """The held-out text of each type, by the name the tables give it (no compile command reads them)."""
    return {
        "Moby-Dick": load_corpus("moby-dick"),
        "Jekyll and Hyde": held_out_text("jekyll"),
        "code": held_out_text("code"),
        "docs": held_out_text("docs"),
    }


def paired_rows(
    captured: dict[tuple[str, str, float], list[float]], baseline: str, column: str, difference: str
) -> list[dict[str, object]]:
    """One row per (text, variant, ratio): its mean captured mass and its paired difference from `baseline`'s on the
    same prompts, with the difference's 95% bootstrap interval."""
    rows = []
    for (text, name, ratio), values in captured.items():
        differences = [a - b for a, b in zip(values, captured[(text, baseline, ratio)])]
        low, high = bootstrap_interval(differences)
        rows.append(
            {
                "text": text,
                column: name,
                "ratio": ratio,
                "captured": round(sum(values) / len(values), 4),
                difference: round(sum(differences) / len(differences), 4),
                "low_95": round(low, 4),
                "high_95": round(high, 4),
                "prompts": len(values),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-prompts", type=int, default=16)
    parser.add_argument("--tokens-per-prompt", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=5, help="held-out prompts per text type")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--scorer", default=str(default_artifact("default", "distilled_scorer")))
    parser.add_argument("--out", default="benchmarks/distilled/student_features.md")
    args = parser.parse_args()
    model, tokenizer = kvruntime.load_model("default")
    scorer = DistilledScorer.from_artifact(kvruntime.load_artifact(args.scorer, model=model))
    generator = torch.Generator().manual_seed(0)
    training = calibration_prompts(load_corpus(REPEATING_CORPUS), tokenizer, args.train_prompts, args.tokens, seed=0)
    samples = [
        sampled(prompt_inputs(model, tokenizer, ids, scorer.oracle), args.tokens_per_prompt, generator)
        for _, ids in tqdm(training, desc="training prompts", unit="prompt")
    ]
    layers = samples[0]["y"].shape[0]
    fitted = fit_variants(samples, layers)
    del samples
    texts = held_out_texts()
    captured: dict[tuple[str, str, float], list[float]] = {}
    for text, corpus in texts.items():
        for _, ids in tqdm(calibration_prompts(corpus, tokenizer, args.prompts, args.tokens, 7), desc=text):
            inputs = prompt_inputs(model, tokenizer, ids, scorer.oracle)
            predictions = {"shipped scorer": torch.einsum("lnf,lfh->lhn", inputs["x"], scorer.weights)}
            for name, weights in fitted.items():
                predictions[name] = torch.stack(
                    [
                        torch.stack([variant_inputs(name, inputs, i, h) @ w[:, h].float() for h in range(w.shape[1])])
                        for i, w in enumerate(weights)
                    ]
                )
            for name, scores in predictions.items():
                for ratio in RATIOS:
                    per_layer = [captured_mass(scores[i], inputs["y"][i], ratio) for i in range(layers)]
                    captured.setdefault((text, name, ratio), []).append(sum(per_layer) / layers)
    rows = paired_rows(captured, BASELINE, "student", "minus_ridge")
    markdown = "\n".join(
        [
            "# Distilled: one-pass levers against the teacher, per text type (issue #63)",
            "",
            *run_header(),
            f"Fitted on {args.tokens_per_prompt} "
            f"tokens of each of {args.train_prompts} `austen-repeats` prompts ({args.tokens} tokens); scored on "
            f"{args.prompts} held-out prompts of {args.tokens} tokens per text type. `captured`: the teacher's score "
            "mass the student's per-head top-k holds over the teacher's own top-k's, mean over layers, KV heads "
            "and prompts; `minus_ridge`: paired with the ridge refitted on the same tokens (95% bootstrap interval).",
            "",
            *markdown_table(rows),
            "",
        ]
    )
    write_results(rows, Path(args.out), markdown)


if __name__ == "__main__":
    main()
