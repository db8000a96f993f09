"""bench/set_scale.py's bookkeeping on hand-built runs (the measurement itself: `nexttoken bench --only sets`)."""

from __future__ import annotations

import math

from bench import set_scale


def _run(n: int, peak: float) -> dict:
    stage = {"work_s_per_prompt": 0.1, "wall_s": 1.0, "peak_mb": peak, "disk_mb_per_prompt": 0.2}
    return {"N": n, "stages": {s: dict(stage) for s in set_scale.STAGES}, "work_s_per_prompt": 0.8,
            "floor_s_per_prompt": 0.4, "work_vs_floor": 2.0, "disk_mb_per_prompt": 1.6}


def test_prompts_are_distinct_ids_and_texts():
    ps = set_scale.prompts(1000)
    assert len({p["id"] for p in ps}) == len({p["text"] for p in ps}) == 1000


def test_peak_rss_slope_is_the_log_log_growth():
    runs = [_run(10, 100.0), _run(100, 200.0), _run(1000, 400.0)]     # x2 per x10: slope log10(2)
    fit = set_scale.fits(runs)
    assert fit["sizes"] == [10, 100, 1000]
    assert math.isclose(fit["forward_peak_rss"], math.log10(2), abs_tol=1e-3)
    flat = set_scale.fits([_run(10, 500.0), _run(100, 500.0)])
    assert flat["probs_peak_rss"] == 0.0


def test_table_prints_every_size_and_the_slopes():
    runs = [_run(10, 100.0), _run(100, 100.0)]
    text = set_scale.table({"runs": {"serial": runs}, "fits": {"serial": set_scale.fits(runs)}})
    lines = text.splitlines()
    assert lines[2].split()[0] == "10" and lines[3].split()[0] == "100"
    assert "rss 0.000" in lines[4] and "nan" not in lines[4]
