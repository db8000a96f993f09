"""Stage report: report.md (an overview of the run's prompts, then the article's tables for one of them,
`report.prompt_id`) and plots/*.png, from the artifacts."""

from __future__ import annotations

from pipeline.config import prompt_set
from pipeline.store import graph, paths
from pipeline.store.artifacts import entry, stage_main, stage_run

STAGE = "report"


def work(cfg: graph.StageConfig) -> None:
    report = cfg.section("report")
    from pipeline.report import equivalence, overview, pages, plots, render, set_plots
    with stage_run(STAGE, cfg.recorded) as run:
        run.with_torch = False        # no torch here: the manifest records no kernel path
        ids = run.prompt_ids(paths.TOKENS)
        chosen = prompt_set.detailed(report.prompt_id, ids)   # an id the run lacks: one line, before any read
        prompts = overview.load(run.use, ids)
        inputs = render.load(run.use, chosen, prompts=prompts)
        run.model = inputs.manifests.get("forward", {}).get("model")
        font = plots.fonts()
        run.use(paths.manifest_path("validate"))     # the record of the params.yaml this report shows
        run.facts = {"fonts": list(font.families), "checks_present": inputs.checks is not None,
                     "prompts": len(ids), "detail": chosen,
                     # the config this report shows (validate's record of params.yaml), named by a report a
                     # later run marks stale
                     "params_sha256": graph.validated_params_sha256(run.root)}
        figures = render.draw(inputs, run.out, font)
        across = set_plots.draw(prompts, run.out, font)
        files = pages.write(run.use, run.out, inputs, ids, lambda pid: render.load(run.use, pid, prompts=prompts),
                            language=report.language)
        run.facts["explorer_pages"] = len(files)
        text = render.render(inputs, figures, font, prompts, across) \
            + equivalence.markdown(equivalence.load(run.use, chosen), chosen)
        run.out(paths.REPORT[1]).write_text(text, encoding="utf-8")


main = entry(STAGE, work)

if __name__ == "__main__":
    stage_main(STAGE, main)
