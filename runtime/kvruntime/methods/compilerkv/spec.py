"""CompilerKV's registration (`kvruntime.registry`)."""

from ...registry import MethodSpec, Option

THRESHOLD_RANGE = (0.8, 1.0)  # T_gate's range: the compiled tables' and the fixed_threshold option's


SPEC = MethodSpec(
    name="compilerkv",
    summary="CompilerKV: compiled head-reliability weights and a risk-adaptive threshold gate, by compiled budget",
    window=64,
    needs="compilerkv_tables",
    options={
        "nearest_budget": Option(
            bool, False, "serve a budget that was not compiled with the nearest compiled one (a ratio always is)"
        ),
        "uniform_heads": Option(bool, False, "W_head = 1 (the paper's ablation)"),
        "fixed_threshold": Option(
            float, None, "one threshold for every layer instead of T_gate (ablation)", *THRESHOLD_RANGE
        ),
        "elastic": Option(
            bool, None, "the paper's elastic gate (keeps less on low-risk prompts); default: the tables'"
        ),
    },
    streams=lambda options: False,  # the gate compares every layer's scores
    operating_points=True,
)
