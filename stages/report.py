"""Stage report: report.md (the article's tables from this run's numbers) and plots/*.png."""

from __future__ import annotations

from pipeline.report import plots, render
from pipeline.store import paths
from pipeline.store.artifacts import stage_main, stage_run

STAGE = "report"


def main() -> None:
    with stage_run(STAGE, {}) as run:
        # the run's prompt (a set of one today; a set's overview and chosen prompt: issue 17 item 6)
        inputs = render.load(run.use, run.prompt_ids(paths.TOKENS)[0])
        run.model = inputs.manifests.get("forward", {}).get("model")
        font = plots.fonts()
        run.facts = {"fonts": list(font.families), "checks_present": inputs.checks is not None}
        figures = render.draw(inputs, run.out, font)
        run.out(paths.REPORT[1]).write_text(render.render(inputs, figures, font), encoding="utf-8")


if __name__ == "__main__":
    stage_main(STAGE, main)
