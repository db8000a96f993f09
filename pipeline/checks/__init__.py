"""Checks: re-derive the recorded numbers and judge them.

`verdicts` (one check's record and the checks table), `recompute` (exact recomputations of
captured tensors), `suite` and `trajectory` (the checks themselves), `reference` (the
published reference figures) and `stage` (the checks stage's whole computation, shared with
`nexttoken audit`).
"""
