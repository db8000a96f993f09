"""The attribution stage's recording: per chosen prompt, its two tables (`pipeline.model.attribution`) into its
partition, then the checks on them (`pipeline.checks.attribution`) into the stage's own checks.parquet."""

from __future__ import annotations

import torch

from pipeline.checks.attribution import completeness_check, parts_checks
from pipeline.checks.verdicts import Check, to_table
from pipeline.config.schema import AttributionConfig, CaptureConfig, ModelConfig
from pipeline.model import input_attribution, loader
from pipeline.model.attribution import INPUTS_SCHEMA, PARTS_SCHEMA, Prompt, check_top_k, chosen, one_prompt, table
from pipeline.store import paths, provenance
from pipeline.store.artifacts import StageRun, read_json, read_parquet, read_safetensors


def record(stage: StageRun, model_cfg: ModelConfig, cap: CaptureConfig, cfg: AttributionConfig,
           report_prompt: str | None) -> dict[str, Prompt]:
    """Every chosen prompt's two tables into `stage` -> the results per prompt (for the checks)."""
    pids = chosen(cfg, report_prompt, stage.prompt_ids(paths.CAPTURE))     # an id the run lacks: before any load
    for pid in pids:
        check_top_k(cfg.top_k, read_json(stage.use(paths.FORWARD_FACTS, pid))["output_size"])
    source = read_json(stage.use(paths.SOURCE))
    snapshot = loader.snapshot_dir(stage.use(paths.stage_dir("prepare_model")), source)
    model = loader.load_captured(snapshot, cap, model_cfg.trust_remote_code)
    model32 = model if model.dtype == torch.float32 else loader.load_model(
        snapshot, torch.float32, loader.resolve_device(cap.device), cap.attn_implementation,
        model_cfg.trust_remote_code)
    stage.model = {**provenance.model_record(source), "trust_remote_code": model_cfg.trust_remote_code}
    tokenizer = loader.load_tokenizer(snapshot)
    done = {}
    for pid in pids:
        with stage.timed(pid):
            tokens = read_parquet(stage.use(paths.TOKENS, pid), columns=["position", "token_id"]).to_pandas()
            ids = torch.tensor([tokens.sort_values("position")["token_id"].tolist()])
            tensors = read_safetensors(stage.use(paths.CAPTURE, pid))
            baseline = input_attribution.baseline_ids(ids, tokenizer)
            one = done[pid] = one_prompt(model, model32, ids, baseline, tensors, cfg)
            stage.facts = {"top_k": cfg.top_k, "ig_steps": cfg.ig_steps, "position": ids.shape[1] - 1,
                           "ig_baseline_ids": sorted(set(baseline[0].tolist())),
                           "ig_baseline_kept": (baseline == ids)[0].nonzero().flatten().tolist(),
                           "logit_parts": one.not_applicable or "recorded", **one.facts}
            stage.write_parquet(paths.LOGIT_PARTS[1], table(one.parts, PARTS_SCHEMA), prompt_id=pid)
            stage.write_parquet(paths.INPUTS[1], table(one.inputs, INPUTS_SCHEMA), prompt_id=pid)
    return done



def record_checks(stage: StageRun, done: dict) -> list[Check]:
    """Every chosen prompt's checks (`done`: `record`'s results) -> checks.parquet."""
    results = []
    for pid, one in done.items():
        mine = [*parts_checks(stage.out(paths.LOGIT_PARTS[1], pid), one.residual, one.capture, one.not_applicable),
                completeness_check(stage.out(paths.INPUTS[1], pid))]
        results += [Check(c.name, c.what, c.measured, c.tolerance, c.severity, c.detail, prompt_id=pid) for c in mine]
    stage.write_parquet(paths.ATTRIBUTION_CHECKS[1], to_table(results))
    return results
