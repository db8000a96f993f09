"""The forward stage's recording: per prompt, one captured pass over its stored tokens -> capture.safetensors +
facts.json in its partition (the pass itself: `pipeline.model.forward`)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.executor.work import LoadsInSetup
from pipeline.model import memory
from pipeline.model.forward import ForwardPlan, check_tokens, load, manifest_facts, run, save_capture
from pipeline.store import paths
from pipeline.store.artifacts import StageRun, read_json, read_parquet


def record(stage: StageRun, p: ForwardPlan, trust_remote_code: bool, executor=None) -> None:
    """Per prompt, one captured pass over its stored tokens -> capture.safetensors +
    facts.json in its partition; the model loads once for the set (once per worker on Ray:
    `pipeline.executor`; `executor` None runs here)."""
    from pipeline.executor import run as ex
    stage.use(paths.stage_dir("prepare_model"))
    longest = 0
    pids = stage.prompt_ids(paths.TOKENS)
    for pid in pids:                                    # every prompt refused or not before the model loads
        ids = read_parquet(stage.use(paths.TOKENS, pid), columns=["token_id"])["token_id"].to_pylist()
        check_tokens(ids, read_json(stage.use(paths.TOKENIZE_SUMMARY, pid))["tokenizer_len"])
        longest = max(longest, len(ids))
    memory.guard(memory.estimate(p.snapshot, p.dtype, longest, p.spec, trust_remote_code), p.device, p.spread)
    stage.model = {**p.model_record, "trust_remote_code": trust_remote_code}
    ex.run_prompts(stage, ForwardWork(p, trust_remote_code, longest), pids, executor or ex.SERIAL)


@dataclass
class ForwardWork(LoadsInSetup):
    """One prompt's captured pass (`pipeline.executor.PromptWork`): the model loads in `setup`."""
    plan: ForwardPlan
    trust_remote_code: bool
    longest: int
    stage: str = "forward"

    def setup(self) -> None:
        self._model = load(self.plan, self.longest, self.trust_remote_code)

    def run(self, out, pid: str) -> None:
        ids = read_parquet(out.use(paths.TOKENS, pid), columns=["token_id"])["token_id"].to_pylist()
        tokenizer_len = read_json(out.use(paths.TOKENIZE_SUMMARY, pid))["tokenizer_len"]
        result = run(self.plan, ids, tokenizer_len, trust_remote_code=self.trust_remote_code, model=self._model)
        out.facts = manifest_facts(result.facts)
        save_capture(result, out.out(paths.CAPTURE[1], pid))
        out.write_json(paths.FORWARD_FACTS[1], result.facts, prompt_id=pid)

