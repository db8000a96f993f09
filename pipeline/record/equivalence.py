"""The equivalence stage's recording: per chosen prompt, the matrix's rows (`pipeline.equivalence.matrix`) and each
forward variation's logits streamed into its partition, then the checks on them (`pipeline.checks.equivalence`)
into the stage's own checks.parquet."""

from __future__ import annotations

import pyarrow as pa

from pipeline.checks.equivalence import all_checks
from pipeline.checks.verdicts import Check, to_table
from pipeline.config.schema import CaptureConfig, EquivalenceConfig
from pipeline.equivalence import budget
from pipeline.equivalence import variations as v
from pipeline.equivalence.matrix import (
    SCHEMA,
    Matrix,
    chosen,
    fillers_and_pad,
    forward_rows,
    kv_rows,
    plan,
    recorded,
    setup,
    step_runs,
)
from pipeline.model import capture, loader, trajectories
from pipeline.store import logits_io, paths, provenance, variant_logits
from pipeline.store.artifacts import StageRun, read_json


def plans(stage: StageRun, s: v.Setup, cfg: EquivalenceConfig, pids: list[str], fillers: list[list[int]],
          weights: int) -> dict[str, budget.Plan]:
    """Each chosen prompt's memory plan (`matrix.plan`), from its recorded facts, before any load."""
    return {pid: plan(s, cfg, read_json(stage.use(paths.FORWARD_FACTS, pid)), fillers, weights, pid) for pid in pids}


def write_variants(stage: StageRun, pid: str, rows, positions: list[int]) -> None:
    """Stream each variant's logits to variant_logits.parquet as the variation yields them (one [P, V] held at a
    time): `variant_logits.write`'s layout, fed one variation after another."""
    current: dict = {}

    def logit_rows():
        for name, logits in rows:
            current.update(variation=name, dtype=str(logits.dtype).removeprefix("torch."))
            for i, p in enumerate(positions):
                yield p, logits[i].clone()      # a copy: the writer's last row must not keep all of [P, V] alive
            del logits                          # ... while the next variation runs

    def keys():
        while True:
            yield dict(current)
    logits_io.write_logits(stage.out(paths.VARIANT_LOGITS[1], pid), logit_rows(), stage.parquet_metadata(),
                           extra_schema=variant_logits.KEYS, extra_values=keys())


def record(stage: StageRun, cap: CaptureConfig, cfg: EquivalenceConfig, report_prompt: str | None,
           trust_remote_code: bool) -> Matrix:
    """Every chosen prompt's matrix into `stage`."""
    pids = chosen(cfg, report_prompt, stage.prompt_ids(paths.CAPTURE))    # an id the run lacks: before any load
    source = read_json(stage.use(paths.SOURCE))
    snapshot = loader.snapshot_dir(stage.use(paths.stage_dir("prepare_model")), source)
    s = setup(cap, snapshot, trust_remote_code)
    fillers, pad_id = fillers_and_pad(snapshot, cfg, trust_remote_code)
    planned = plans(stage, s, cfg, pids, fillers, loader.weights_bytes(snapshot, s.dtype))     # before the load
    model = loader.load_model(s.snapshot, s.dtype, s.device, s.attn, trust_remote_code)
    stage.model = {**provenance.model_record(source), "trust_remote_code": trust_remote_code}
    ran: dict = {}
    matrices = {pid: one_prompt(stage, pid, s, cfg, model, (fillers, pad_id), planned[pid], ran) for pid in pids}
    return Matrix(s, fillers, pad_id, matrices, ran)


def one_prompt(stage: StageRun, pid: str, s: v.Setup, cfg: EquivalenceConfig, model, batch: tuple[list, int],
               plan: budget.Plan, ran: dict) -> tuple[v.Recorded, list[dict]]:
    """The prompt's rows and variant logits into `stage`; (the record, slimmed to what the checks read, rows)."""
    with stage.timed(pid):
        rec = recorded(stage.use(paths.CAPTURE, pid), read_json(stage.use(paths.FORWARD_FACTS, pid)))
        rows: list[dict] = []

        def variants():
            for r, with_, logits in forward_rows(rec, s, cfg, model, *batch, plan):
                rows.append(r)
                ran[r["variation"]] = with_
                if logits is not None:
                    yield r["variation"], logits
                del logits                      # not alive while the next variation runs
        write_variants(stage, pid, variants(), rec.positions)
        if "kv_cache" in cfg.variations:
            rows += kv_rows(step_runs(stage.use(paths.STEPS, pid),
                                      trajectories.step_rows(stage.use, stage.root, pid, lambda: model)))
        stage.write_parquet(paths.EQUIVALENCE[1], pa.Table.from_pylist([{k: r.get(k) for k in SCHEMA.names}
                                                                        for r in rows], SCHEMA), prompt_id=pid)
    # the checks read the ids, positions and logits only: the rest of the capture goes
    logits = capture.act_name("logits")
    return v.Recorded(rec.ids, rec.positions, {logits: rec.tensors[logits]}, rec.order), rows


def record_checks(stage: StageRun, matrix: Matrix, cfg: EquivalenceConfig) -> list[Check]:
    """Every check on the matrix -> the stage's checks.parquet."""
    results = all_checks(matrix, cfg)
    stage.write_parquet(paths.EQUIVALENCE_CHECKS[1], to_table(results))
    return results
