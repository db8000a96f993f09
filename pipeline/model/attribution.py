"""The attribution stage's computation: per chosen prompt, at its last position, the logit parts of the top
`attribution.top_k` candidates (T = 1) and the top-1's input attribution, as two tables and the figures
its checks compare (`pipeline.checks.attribution`).

The parts come from the model loaded as forward loaded it (`pipeline.model.logit_parts`, the capture's
dtype: its hooked pass must give the capture's bits); the input attribution from a second load in
float32 (`pipeline.model.input_attribution`: gradients of bf16 logits are too coarse to integrate). A
model the split is not written for (`logit_parts.NotApplicable`) gets empty parts tables with the same
schema and its reason in the facts: a reason, not an error in the numbers (issue 50); its input
attribution still runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
import pyarrow as pa
import torch

from pipeline.config import prompt_set
from pipeline.config.schema import AttributionConfig
from pipeline.errors import bad_value
from pipeline.model import input_attribution
from pipeline.model import logit_parts as parts
from pipeline.model.capture import act_name
from pipeline.numerics import logit_parts as lp
from pipeline.numerics import parts_table

PARTS_SCHEMA = pa.schema([pa.field(name, kind, nullable=name in ("layer", "head")) for name, kind in (
    ("position", pa.int32()), ("token_id", pa.int32()), ("component", pa.string()), ("layer", pa.int32()),
    ("head", pa.int32()), ("contribution", pa.float64()), ("logit", pa.float64()), ("logit_fp64", pa.float64()),
    ("bound", pa.float64()))])
INPUTS_SCHEMA = pa.schema([pa.field(name, kind, nullable=False) for name, kind in (
    ("target_position", pa.int32()), ("target_token_id", pa.int32()), ("source_position", pa.int32()),
    ("method", pa.string()), ("attribution", pa.float64()), ("logit_input", pa.float64()),
    ("logit_baseline", pa.float64()))])
assert tuple(PARTS_SCHEMA.names) == parts_table.PARTS_COLUMNS
assert tuple(INPUTS_SCHEMA.names) == input_attribution.COLUMNS


def chosen(cfg: AttributionConfig, report_prompt: str | None, ids: list[str]) -> list[str]:
    """attribution.prompts, or (null) the prompt the report details: one line for an id the run lacks."""
    if cfg.prompts is None:
        return [prompt_set.detailed(report_prompt, ids)]
    for pid in cfg.prompts:
        if pid not in ids:
            raise bad_value("attribution.prompts", pid, "null or a list of the run's prompt ids: " + ", ".join(ids))
    return list(cfg.prompts)


def check_top_k(top_k: int, output_size: int) -> None:
    if top_k > output_size:
        raise bad_value("attribution.top_k", top_k, f"an integer in [1, {output_size}] (this model's output size)")


def table(frame: pd.DataFrame | None, schema: pa.Schema) -> pa.Table:
    """A frame as `schema` (None: the empty table with that schema)."""
    if frame is None:
        return schema.empty_table()
    return pa.Table.from_pandas(frame, schema=schema, preserve_index=False)


@dataclass
class Prompt:
    """One prompt's results: the two tables and the figures the checks read."""

    parts: pd.DataFrame | None          # None: the split does not apply (`not_applicable` says why)
    inputs: pd.DataFrame
    residual: lp.Gap | None = None
    capture: lp.Gap | None = None
    not_applicable: str | None = None
    facts: dict = field(default_factory=dict)


def one_prompt(model, model32, input_ids: torch.Tensor, baseline: torch.Tensor, tensors: dict,
               cfg: AttributionConfig) -> Prompt:
    """The last position's parts (top_k candidates) and the top-1's input attribution (ig_steps steps from the
    `baseline` ids: `input_attribution.baseline_ids`)."""
    last = input_ids.shape[1] - 1
    power = input_attribution.path_alpha_power(model32, input_ids, baseline)
    ig = {"ig_alpha_power": power}
    try:
        rec = parts.record_parts(model, input_ids, [last])
    except parts.NotApplicable as e:
        logits = tensors[act_name("logits")][0, -1].double()    # the capture's last row: the last position's
        top1 = int(torch.argmax(logits))                 # torch.argmax: the first of equal maxima, the lowest id
        return Prompt(None, input_attribution.attribute(model32, input_ids, [(last, top1)], baseline, cfg.ig_steps,
                                                        power), not_applicable=str(e),
                      facts={"target_token_id": top1, **ig})
    candidates = parts.top_candidates(rec, last, cfg.top_k)
    frame = parts.logit_parts(rec, {last: candidates})
    inputs = input_attribution.attribute(model32, input_ids, [(last, candidates[0])], baseline, cfg.ig_steps, power)
    return Prompt(frame, inputs, parts.residual_check(rec), parts.capture_gap(rec, tensors),
                  facts={"target_token_id": candidates[0], "candidates": candidates,
                         "dtype": str(rec.dtype).removeprefix("torch."), **ig})
