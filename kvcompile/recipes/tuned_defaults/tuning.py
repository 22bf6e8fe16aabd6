"""`kvcompile tune`: for each method, the largest compression ratio whose accuracy on validation prompts stays
within a tolerance of the full cache's, and the recommendation written as a `tuned_defaults` artifact that the
runtime takes as its default method and ratio.

Ratios are tried in increasing order and a method stops at its first ratio out of tolerance (a larger ratio past
a failure is not trusted, and it saves the runs). The validation prompts come from the suite with another seed
than `kvcompile eval`'s default, so the numbers reported by eval are not those the choice was made on."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from kvcompile.calibration.corpus import load_corpus
from kvcompile.calibration.provenance import provenance
from kvcompile.evaluation.contestants import Contestant
from kvcompile.evaluation.metrics import grouped, largest_ratio_within, within_tolerance
from kvcompile.evaluation.report import method_curves
from kvcompile.evaluation.settings import SuiteSettings
from kvcompile.evaluation.store import RunStore
from kvcompile.evaluation.suite_run import HELD_OUT_BOOK, reference_answer, run_prompt
from kvruntime import Artifact, model_fingerprint
from kvruntime.models.model_spec import loaded_position_limit

UNMEASURED = -1.0  # accuracy/kl of a ratio not tried (the method had stopped before it)


def tune(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    contestants: list[Contestant],
    artifacts: dict[str, list[Path]],
    settings: SuiteSettings,
    tolerance: float,
    store: RunStore,
) -> Artifact:
    """Tune and return the `tuned_defaults` artifact."""
    corpus = load_corpus(HELD_OUT_BOOK)
    prompts = settings.prompts(corpus, tokenizer, loaded_position_limit(model.config))
    full, methods = contestants[0], contestants[1:]
    references = {}
    bar = tqdm(total=len(prompts) * (1 + len(methods) * len(settings.ratios)), desc="kvcompile tune", unit="run")
    for index, prompt in enumerate(prompts):
        reference, scoring, record = reference_answer(model, tokenizer, index, prompt, full, settings)
        references[index] = (reference, scoring)
        if not store.done(index, full.label, 0.0):
            store.add([record])
        bar.update()
    full_accuracy = method_curves(store.records)[full.label][0.0]
    alive = list(methods)
    for ratio in settings.ratios:
        if not alive:
            break
        jobs = [(c, ratio) for c in alive]
        for index, prompt in enumerate(prompts):
            left = [(c, r) for c, r in jobs if not store.done(index, c.label, r)]
            bar.update(len(jobs) - len(left))
            if left:
                results = run_prompt(model, tokenizer, index, prompt, left, artifacts, settings, references[index], bar)
                store.add([r for _, r in results])
        curves = method_curves(store.records)
        alive = [c for c in alive if within_tolerance(full_accuracy, curves[c.label][ratio], tolerance)]
        later = len(settings.ratios) - settings.ratios.index(ratio) - 1
        bar.total = bar.n + len(prompts) * len(alive) * later  # stopped methods run no more
        bar.refresh()
    bar.close()
    return recommendation(model, contestants, artifacts, settings, tolerance, store.records, corpus)


def recommendation(
    model: nn.Module,
    contestants: list[Contestant],
    artifacts: dict[str, list[Path]],
    settings: SuiteSettings,
    tolerance: float,
    records: list[dict],
    corpus: object,
) -> Artifact:
    """The `tuned_defaults` artifact: every method's measured curve and largest ratio within tolerance, and the
    recommended method (the largest such ratio; ties go to the better accuracy, then the smaller KL), with the
    artifacts it needs named by file name."""
    cells = grouped(records, lambda r: (r["method"], r["ratio"]))

    def mean(field: str, label: str, ratio: float) -> float | None:
        cell = cells.get((label, ratio))
        return statistics.mean(x[field] for x in cell) if cell else None

    full_accuracy = mean("correct", contestants[0].label, 0.0)
    methods = contestants[1:]
    accuracy = [[mean("correct", c.label, r) for r in settings.ratios] for c in methods]
    kl = [[mean("kl", c.label, r) for r in settings.ratios] for c in methods]
    chosen = [
        largest_ratio_within(full_accuracy, {r: a for r, a in zip(settings.ratios, row) if a is not None}, tolerance)
        for row in accuracy
    ]

    def rank(m: int) -> tuple:
        r = settings.ratios.index(chosen[m])
        return chosen[m], accuracy[m][r], -kl[m][r]

    best = max((m for m in range(len(methods)) if chosen[m] is not None), key=rank, default=None)
    recommended = None
    if best is not None:
        r = settings.ratios.index(chosen[best])
        recommended = dict(
            method=methods[best].method,
            options=dict(methods[best].options),
            ratio=chosen[best],
            accuracy=accuracy[best][r],
            label=methods[best].label,
            # File names: the runtime looks for them beside the tuned_defaults file (TuneRecipe copies them there).
            artifacts=[path.name for path in artifacts.get(methods[best].label, [])],
        )

    def table(rows: list[list[float | None]]) -> torch.Tensor:
        return torch.tensor([[UNMEASURED if v is None else v for v in row] for row in rows], dtype=torch.float32)

    return Artifact(
        kind="tuned_defaults",
        tensors=dict(
            ratios=torch.tensor(settings.ratios, dtype=torch.float32),
            accuracy=table(accuracy),
            kl=table(kl),
            chosen_ratio=table([[UNMEASURED if c is None else c for c in chosen]])[0],
            full_accuracy=torch.tensor([full_accuracy], dtype=torch.float32),
        ),
        model=model_fingerprint(model),
        provenance=provenance(corpus, settings.seed, validation_prompts=len({x["prompt"] for x in records})),
        params=dict(
            methods=[c.label for c in methods],
            tolerance=tolerance,
            tasks=list(settings.tasks),
            lengths=list(settings.lengths),
            samples=settings.samples,
            question_aware=settings.question_aware,
            recommended=recommended,
            **({} if settings.suite is None else {"suite": settings.suite_name, "scoring": settings.scoring}),
        ),
    )


def describe_tuning(artifact: Artifact) -> str:
    """One line per method (its largest ratio within tolerance and the accuracy there), then the recommendation."""
    t, params = artifact.tensors, artifact.params
    ratios = [round(r, 4) for r in t["ratios"].tolist()]
    lines = [f"full cache: validation accuracy {float(t['full_accuracy'][0]):.3f}; tolerance {params['tolerance']}"]
    for m, label in enumerate(params["methods"]):
        chosen = float(t["chosen_ratio"][m])
        measured = ", ".join(f"{r}: {a:.3f}" for r, a in zip(ratios, t["accuracy"][m].tolist()) if a >= 0)
        verdict = f"largest ratio within tolerance {round(chosen, 4)}" if chosen >= 0 else "no ratio within tolerance"
        lines.append(f"{label}: {verdict} (accuracy by ratio: {measured})")
    recommended = params["recommended"]
    lines.append(
        f"recommended: {recommended['label']} at ratio {recommended['ratio']}"
        if recommended
        else "recommended: none (no method stays within the tolerance at the smallest ratio tried)"
    )
    return "\n".join(lines)
