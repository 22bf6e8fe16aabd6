"""Distilled's registration (`kvruntime.registry`)."""

from ...registry import MethodSpec, Option

ALLOCATION = Option(
    ("dynamic", "compiled", "uniform"),
    "compiled",
    "layer shares: the teacher's compiled shares (streams), one global pool, or the same count",
)

SPEC = MethodSpec(
    name="distilled",
    summary="kvcompile's own: a compiled one-pass scorer of what a second pass over the context would find",
    window=16,
    needs="distilled_scorer",
    options={
        "allocation": ALLOCATION,
        "floor": Option(
            float,
            0.25,
            "share of the average count every layer keeps (dynamic; compiled: the shares re-floored)",
            minimum=0.0,
            maximum=1.0,
        ),
        # Repeated text asks for more layers than the teacher's shares give it, at 0.5 most (docs/methods/distilled.md).
        "repeating_floor": Option(
            float,
            0.5,
            "the compiled shares' floor for a prompt whose text repeats (a quarter or more of its 8-grams seen "
            "earlier in it)",
            minimum=0.0,
            maximum=1.0,
        ),
        "sinks": Option(int, 1, "the first N tokens always stay (attention sinks)", minimum=0),
        # The student ranks the copies of a repeated text alike, the keys' geometry (`leverage.py`) ranks them apart.
        "leverage": Option(
            float,
            0.0,
            "weight of the keys' leverage (unlike the other keys) mixed into the predicted scores",
            minimum=0.0,
        ),
        # The student ranks the copies of a repeated text alike; the last copy, the one read last, is worth the most
        # (docs/methods/distilled.md).
        "copy_penalty": Option(
            float,
            0.25,
            "log-score taken from a token per doubling of the times the 8-gram ending at it occurs again later in "
            "the prompt (the earlier copies of a repeated text give way to the last)",
            minimum=0.0,
        ),
        "scores": Option(("predicted", "oracle"), "predicted", "oracle: the teacher, replayed by a second pass"),
        # Its queries' attention over the whole prompt sees what one token's features cannot (docs/methods/distilled.md).
        "lookahead": Option(
            ("auto", "off"),
            "auto",
            "auto: the scorer's lookahead queries (when it has them) are fed after a prompt given in one piece and "
            "their log-scores averaged with the student's; a prompt streamed in chunks is scored by the student alone",
        ),
    },
    streams=lambda options: (
        options.get("allocation", ALLOCATION.default) in ("compiled", "uniform")
        and options.get("scores", "predicted") == "predicted"
    ),
    error_aware=True,
    options_with_error_aware=False,  # the layer shares come from the layer_budgets artifact
)
