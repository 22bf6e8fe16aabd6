"""Where the default `distilled` loses the pass key in repeated filler: on the bar's pass-key prompts (seed 15, 1k-4k),
per layer, the share of the key's digit tokens each KV head keeps, under the compiled shares at 0.5, 0.75 and 0.9
and under uniform shares at 0.5, with whether the answer holds the key.

    python -m benchmarks.distilled.passkey_layers   # 4 min on 2 cores
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import kvruntime
from benchmarks.reporting import markdown_table, run_header, write_results
from kvcompile.calibration.corpus import HELD_OUT_CORPUS, load_corpus
from kvcompile.evaluation.runner import split_prompt
from kvcompile.evaluation.settings import SuiteSettings
from kvcompile.recipe import default_artifact

SCORER = str(default_artifact("default", "distilled_scorer"))
VARIANTS = {  # label: (ratio, options)
    "compiled 0.5": (0.5, {}),
    "compiled 0.75": (0.75, {}),
    "compiled 0.9": (0.9, {}),
    "uniform 0.5": (0.5, {"allocation": "uniform"}),
}


def key_positions(tokenizer: object, ids: list[int], key: str) -> torch.Tensor:
    """The positions of the context's digit tokens that belong to the key (where the key is stated)."""
    digits = [i for i, t in enumerate(ids) if (text := tokenizer.decode([t]).strip()).isdigit() and text in key]
    if not digits:
        raise SystemExit(f"no token of the key {key} found in the context")
    return torch.tensor(digits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--scorer", default=SCORER, help="the distilled_scorer artifact (a variant's, to compare)")
    parser.add_argument("--out", default="benchmarks/distilled/passkey_layers.md")
    args = parser.parse_args()
    model, tokenizer = kvruntime.load_model()
    settings = SuiteSettings((0.5,), ("passkey",), (1024, 2048, 4096), 4, args.seed, False, 16)
    prompts = settings.prompts(load_corpus(HELD_OUT_CORPUS), tokenizer, model.config.max_position_embeddings)
    kept = {label: torch.zeros(model.config.num_hidden_layers) for label in VARIANTS}
    answers = dict.fromkeys(VARIANTS, 0)
    for prompt in prompts:
        context, question = split_prompt(tokenizer, prompt, False)
        digits = key_positions(tokenizer, context[0].tolist(), prompt.expected[0])
        for label, (ratio, options) in VARIANTS.items():
            with kvruntime.compress(
                model, "distilled", ratio=ratio, artifacts=[args.scorer], options=options
            ) as session:
                compressed = session.prefill(context)
                output = compressed.generate(question, max_new_tokens=12, do_sample=False, pad_token_id=0)
                answers[label] += prompt.expected[0] in tokenizer.decode(output[0, question.shape[1] :])
                for layer, positions in enumerate(session.kept_positions):  # [1, Hkv, slots]
                    held = torch.stack([torch.isin(digits, head) for head in positions[0]]).float()
                    kept[label][layer] += held.mean() / len(prompts)
        print(prompt.length, prompt.expected[0], answers, flush=True)
    rows = [
        {"layer": layer, **{label: f"{float(kept[label][layer]):.2f}" for label in VARIANTS}}
        for layer in range(model.config.num_hidden_layers)
    ]
    rows.append({"layer": "answers", **{label: f"{answers[label]} of {len(prompts)}" for label in VARIANTS}})
    lines = [
        "# Where the pass key in repeated filler is lost",
        "",
        *run_header(),
        "",
        f"{len(prompts)} pass-key prompts in repeated filler (seed {args.seed}, 1k, 2k and 4k tokens), question-agnostic,"
        f" the scorer {args.scorer}. Per layer: the share of the key's digit tokens kept, averaged over KV heads and prompts.",
        "",
        *markdown_table(rows),
        "",
    ]
    write_results(rows, Path(args.out), "\n".join(lines))


if __name__ == "__main__":
    main()
