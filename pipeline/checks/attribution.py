"""Checks on the attribution stage's tables, written to its own checks.parquet (the checks stage's schema).

Own table, as the equivalence stage's: the parts come from a hooked forward pass the stage runs, and
two of these checks compare that pass itself (not only its stored table), which the checks stage does
not hold.

- `attribution_logit_parts_sum` (error): per candidate, the FP64 sum of its parts against its logit
  recomputed in FP64 from the recorded final-norm output and the LM head (a derivation that never uses the
  frozen scale), within the bound derived from the dtype (`numerics.logit_parts.logit_bound`). Read back
  from the stored logit_parts.parquet: the check is on what a reader gets. A fold that forgets the norm's
  weight or unfreezes its scale fails it.
- `attribution_residual_sum` (error): the parts' FP64 sum against the recorded final-norm input, element
  by element, within the first-order rounding bound (`numerics.logit_parts.residual_bound`).
- `attribution_capture_exact` (error): the hooked pass against the forward stage's capture of the same
  prompt (final-norm input and output, and the logits where the capture holds every row): bound 0, so the
  parts belong to the recorded run.
- `attribution_ig_completeness` (report): per target, |sum of the IG attributions - (logit(input) -
  logit(baseline))| / |logit(input) - logit(baseline)|, against the stated bound
  `input_attribution.COMPLETENESS_REL` (5 %; a stated, not a derived bound: a Riemann sum's error depends on
  the integrand's derivatives). Gemma's norms keep it from converging (docs/attribution.md): reported, never
  a failed run.

Where the split does not apply (the stage's `not applicable: ...`), the three parts checks are one report
check each, measured NaN, the reason in the detail, as an equivalence variation that did not run.
"""

from __future__ import annotations

import math

from pipeline.checks.verdicts import Check, summary
from pipeline.model import input_attribution
from pipeline.numerics import logit_parts as lp
from pipeline.store.artifacts import read_parquet

SUM_WHAT = ("per candidate, the FP64 sum of its logit parts vs its logit recomputed in FP64 from the recorded "
            "final-norm output and the LM head: worst |difference|, tolerance the dtype-derived bound there")
RESIDUAL_WHAT = ("the logit parts' FP64 sum vs the recorded final-norm input, per element: worst |difference|, "
                 "tolerance its first-order rounding bound there")
CAPTURE_WHAT = ("the attribution stage's hooked forward pass vs the forward stage's capture (final-norm input and "
                "output; logits where every row is captured), bit for bit (max |difference|)")
IG_WHAT = (f"integrated gradients' completeness: |sum of attributions - (logit(input) - logit(baseline))| / "
           f"|logit(input) - logit(baseline)|, worst target, against the stated bound "
           f"{input_attribution.COMPLETENESS_REL:g}")


def _gap_check(name: str, what: str, gap: lp.Gap) -> Check:
    return Check(name, what, gap.measured, gap.bound, "error", f"{gap.where}; largest |difference| {gap.largest:.3g}")


def parts_checks(parts_path, residual: lp.Gap | None, capture: lp.Gap | None, not_applicable: str | None) \
        -> list[Check]:
    if not_applicable is not None:
        return [Check(name, what, math.nan, 0.0, "report", not_applicable) for name, what in (
            ("attribution_logit_parts_sum", SUM_WHAT), ("attribution_residual_sum", RESIDUAL_WHAT),
            ("attribution_capture_exact", CAPTURE_WHAT))]
    stored = read_parquet(parts_path).to_pandas()
    return [_gap_check("attribution_logit_parts_sum", SUM_WHAT, lp.sum_check(stored)),
            _gap_check("attribution_residual_sum", RESIDUAL_WHAT, residual),
            _gap_check("attribution_capture_exact", CAPTURE_WHAT, capture)]


def completeness_check(inputs_path) -> Check:
    per = input_attribution.completeness(read_parquet(inputs_path).to_pandas())
    if per.empty:
        return Check("attribution_ig_completeness", IG_WHAT, math.nan, input_attribution.COMPLETENESS_REL, "report",
                     "no target")
    rel = per["gap"] / per["difference"].abs()
    i = int(rel.fillna(math.inf).to_numpy().argmax())
    r = per.iloc[i]
    return Check("attribution_ig_completeness", IG_WHAT, float(rel.iloc[i]), input_attribution.COMPLETENESS_REL,
                 "report", f"target position {int(r.target_position)}, token_id {int(r.target_token_id)}: IG sum "
                 f"{r.ig_sum:.6g} vs logit difference {r.difference:.6g} (gap {r.gap:.3g}); "
                 f"{int(per['within'].sum())} of {len(per)} targets within")


def summary_text(results: list[Check]) -> str:
    s = summary(results)
    return (f"{s['checks']} attribution checks: {s['passed']} pass, {s['failed_error']} error and "
            f"{s['failed_report']} report checks fail"
            + "".join(f"\n  {c.verdict} ({c.severity}) {c.name} [{c.prompt_id}]: {c.measured:g} > {c.tolerance:g}  "
                      f"{c.detail[:160]}" for c in results if not c.passed))

