"""The trajectories stage's recording: per prompt, every run on its stored ids (`pipeline.model.trajectories`)
-> steps, step logits, summary in its partition; then the set's prompt_metrics.parquet and metrics.json."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config.schema import CaptureConfig, ModelConfig, SamplingConfig
from pipeline.executor.work import LoadsInSetup
from pipeline.model import loader
from pipeline.model.trajectories import (
    check_room,
    run_all,
    set_files,
    step_logit_rows,
    steps_table,
    stored_step_logits,
    summary,
)
from pipeline.numerics import probs
from pipeline.store import logits_io, paths, provenance
from pipeline.store.artifacts import StageRun, read_json, read_parquet


def record(stage: StageRun, model_cfg: ModelConfig, cap: CaptureConfig, sampling: SamplingConfig,
           executor=None) -> None:
    """The trajectories stage: per prompt, every run on its stored ids -> steps, step logits, summary
    in its partition; the model loads once for the set (once per worker on Ray: `pipeline.executor`)."""
    from pipeline.executor import run as ex
    source = read_json(stage.use(paths.SOURCE))
    stage.use(paths.stage_dir("prepare_model"))
    snapshot = loader.snapshot_dir(paths.stage_dir("prepare_model", stage.root), source)
    pids = stage.prompt_ids(paths.TOKENS)
    lengths = {pid: read_parquet(stage.use(paths.TOKENS, pid), columns=["token_id"]).num_rows for pid in pids}
    longest = max(lengths, key=lambda pid: lengths[pid])     # every prompt fits before the model loads
    check_room(lengths[longest], sampling.max_new_tokens, loader.max_positions(snapshot),
               longest if len(lengths) > 1 else None)
    stage.model = provenance.model_record(source)
    stage.seeds["sample"] = sampling.seed
    work = TrajectoriesWork(snapshot, cap, sampling, model_cfg.trust_remote_code,
                            stored=frozenset(stored_step_logits(sampling, pids)))
    summaries = ex.run_prompts(stage, work, pids, executor or ex.SERIAL)
    files = set_files(summaries)
    stage.write_json(paths.TRAJECTORIES_METRICS[1], files[paths.TRAJECTORIES_METRICS])
    stage.write_parquet(paths.TRAJECTORY_PROMPT_METRICS[1], files[paths.TRAJECTORY_PROMPT_METRICS])


@dataclass
class TrajectoriesWork(LoadsInSetup):
    """One prompt's runs (`pipeline.executor.PromptWork`) -> (its id, trajectories.json's content)."""
    snapshot: Path
    cap: CaptureConfig
    sampling: SamplingConfig
    trust_remote_code: bool
    stored: frozenset[str] = frozenset()     # the prompts whose step logits are written (`stored_step_logits`)
    stage: str = "trajectories"

    def setup(self) -> None:
        self._model = loader.load_captured(self.snapshot, self.cap, self.trust_remote_code)
        self._tokenizer = loader.load_tokenizer(self.snapshot)

    def run(self, out, pid: str) -> tuple[str, dict]:
        model, tokenizer, sampling = self._model, self._tokenizer, self.sampling
        ids = read_parquet(out.use(paths.TOKENS, pid), columns=["token_id"])["token_id"].to_pylist()
        prompt_id = probs.prompt_id(out.use(paths.TOKENIZE_SUMMARY, pid))
        runs = run_all(model, ids, sampling, loader.eos_ids(model))
        stored = pid in self.stored
        out.facts = {**loader.device_record(model, loader.resolve_device(self.cap.device)),
                     "compute_dtype": self.cap.dtype, "prompt_len": len(ids),
                     "step_logits": "stored" if stored else "derived"}
        out.write_parquet(paths.STEPS[1], steps_table(runs, tokenizer, sampling.top_n), prompt_id=pid,
                          compression="zstd")
        if stored:          # else re-derived when read (`rederive_step_logits`), proven by the recorded sha256
            rows, keys = step_logit_rows(runs)
            logits_io.write_step_logits(out.out(paths.STEP_LOGITS[1], pid), rows, keys, out.parquet_metadata())
        summary_by_run = summary(runs, tokenizer)
        out.write_json(paths.TRAJECTORIES[1], summary_by_run, prompt_id=pid)
        return prompt_id, summary_by_run
