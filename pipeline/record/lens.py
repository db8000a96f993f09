"""The lens stage's recording: per prompt, its capture through every layer's lens (`pipeline.model.lens`) ->
lens.parquet and lens_summary.parquet in its partition."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config.schema import CaptureConfig, LensConfig, ModelConfig
from pipeline.executor.work import LoadsInSetup
from pipeline.model import loader
from pipeline.model.capture import decoder_layers
from pipeline.model.lens import LAYER0, check_top_k, run
from pipeline.store import paths, provenance
from pipeline.store.artifacts import StageRun, read_json, read_safetensors


def record(stage: StageRun, model_cfg: ModelConfig, cap: CaptureConfig, cfg: LensConfig, executor=None) -> None:
    """Per prompt, its capture through every layer's lens -> lens.parquet and
    lens_summary.parquet in its partition; the model loads once for the set (as forward loaded it; once
    per worker on Ray: `pipeline.executor`)."""
    from pipeline.executor import run as ex
    source = read_json(stage.use(paths.SOURCE))
    snapshot = loader.snapshot_dir(stage.use(paths.stage_dir("prepare_model")), source)
    pids = stage.prompt_ids(paths.CAPTURE)
    for pid in pids:
        check_top_k(cfg.top_k, read_json(stage.use(paths.FORWARD_FACTS, pid))["output_size"])   # before any load
    stage.model = {**provenance.model_record(source), "trust_remote_code": model_cfg.trust_remote_code}
    ex.run_prompts(stage, LensWork(snapshot, cap, cfg, model_cfg.trust_remote_code), pids, executor or ex.SERIAL)


@dataclass
class LensWork(LoadsInSetup):
    """One prompt's lens (`pipeline.executor.PromptWork`): the model loads in `setup`."""
    snapshot: Path
    cap: CaptureConfig
    cfg: LensConfig
    trust_remote_code: bool
    stage: str = "lens"

    def setup(self) -> None:
        self._model = loader.load_captured(self.snapshot, self.cap, self.trust_remote_code)

    def run(self, out, pid: str) -> None:
        facts, cap, top_k = read_json(out.use(paths.FORWARD_FACTS, pid)), self.cap, self.cfg.top_k
        tensors = read_safetensors(out.use(paths.CAPTURE, pid))
        table, summary = run(self._model, tensors, facts["logit_positions"], top_k)
        out.facts = {"layer0": LAYER0, "num_layers": len(decoder_layers(self._model)), "top_k": top_k,
                     "positions": facts["logit_positions"], "compute_dtype": cap.dtype,
                     "output_size": facts["output_size"]}
        out.write_parquet(paths.LENS[1], table, prompt_id=pid)
        out.write_parquet(paths.LENS_SUMMARY[1], summary, prompt_id=pid)

