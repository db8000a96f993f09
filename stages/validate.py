"""Stage validate: all of params.yaml checked before any other stage runs; each stage's resolved config.

DVC runs it first and whenever params.yaml (tracked whole) or a file under prompts/ changes:
every stage that reads params depends on its file here (`paths.validated`), so a bad value
stops `dvc repro` / `dvc exp run` with one line before DVC removes any other stage's outputs.
Its own outputs are `persist` in dvc.yaml (DVC does not delete them before the run), so a
refused config leaves them as they were too. A file changes only when what its stage reads
changes (the prompt file's text, not the folder, for the stages that read the prompt), so
the other stages still skip when their part is unchanged. When every file it would write is already
there, as its manifest records them, it leaves the folder as it is: a rewrite would change only the
manifest's run facts (time, duration, modification times), and so dvc.lock with nothing changed
(`provenance.unchanged_outputs`). No torch import: it takes a second.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.config import prompt_set, schema
from pipeline.model import sources
from pipeline.store import graph, paths, provenance
from pipeline.store.artifacts import entry, stage_main, stage_run

STAGE = "validate"


def work(cfg: None) -> None:
    params = schema.read_params(Path(paths.PARAMS))          # an unknown section is refused here
    sections = {name: schema.load_section(params, name) for name in schema.SECTIONS}
    prompt = sections["prompt"]
    prompt_set.for_run(sections)                             # a bad prompt set, report.prompt_id: one line
    sources.up_front(sections["model"].source, Path.cwd())   # a model that cannot load or be captured: one line
    resolved_prompt = prompt_set.resolved(prompt)
    config = schema.subset(params, graph.PARAMS[STAGE])
    inputs = [Path(given) for given in (prompt.file, prompt.set) if given is not None]
    files = {paths.validated(stage).name: graph.resolved(params, stage, resolved_prompt)
             for stage in graph.validated_stages()}
    # how the per-prompt stages run: read by them, a dependency of none (pipeline/store/graph.py)
    files[paths.validated(graph.EXECUTOR).name] = sections[graph.EXECUTOR].model_dump(mode="json")
    folder = paths.stage_dir(STAGE)
    params_sha256 = provenance.sha256_file(Path(paths.PARAMS))
    if graph.validated_params_sha256() == params_sha256 and provenance.unchanged_outputs(
            folder, Path.cwd(), STAGE, config, {name: provenance.json_bytes(obj) for name, obj in files.items()},
            inputs):
        print(f"nexttoken validate: params.yaml and the prompt files give the files {folder} holds: kept as they are")
        return                                               # a rewrite would change only its manifest's run facts
    with stage_run(STAGE, config) as run:
        run.with_torch = False
        run.facts = {"params_sha256": params_sha256}         # the params.yaml it checked (the report names it)
        for given in inputs:
            run.use(given)                      # its sha256 goes into the manifest
        for name, obj in files.items():
            run.write_json(name, obj)


main = entry(STAGE, work)

if __name__ == "__main__":
    stage_main(STAGE, main)
