"""The explorer's JavaScript numerics (pipeline/report/explorer_page/numerics.mjs) against the Python reference.

This test writes the fixtures (tests/helpers/explorer_ref.py's numpy FP64 softmax, nucleus, greedy pick, SplitMix64
and inverse CDF; explorer.py's own encoders for the embedded arrays) to a temporary file and runs
tests/js/numerics.test.mjs under Node's test runner (Debian's `nodejs`), which also checks that mutants (a float32
softmax, a nucleus keeping one id too many, ...) fail. Nothing float is committed: the fixtures are made here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pipeline.report import explorer
from tests.helpers import explorer_ref

REPO = Path(__file__).resolve().parents[2]
NODE = shutil.which("node")


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 values that are bf16 values (the low half of each zeroed), as logits.parquet holds them."""
    return (np.asarray(x, dtype="<f4").view("<u4") & 0xFFFF0000).view("<f4")


def _cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(46)
    peaked = _bf16(rng.normal(0, 3, 4096))
    peaked[[7, 900, 901]] = peaked.max() + 2       # three equal maxima: ties by lower id
    return {"peaked": peaked,
            "flat": _bf16(rng.normal(0, 0.5, 20000)),
            "ties": _bf16(np.repeat(rng.normal(0, 2, 50), 8)),             # every logit eight times
            "quarters": np.zeros(4, dtype="<f4")}                          # p = 1/4 exactly: top-p 0.5 is reached


def fixtures() -> dict:
    cases = _cases()
    lists = {name: [float(x) for x in logits] for name, logits in cases.items()}
    softmax = [{"name": n, "T": t, "logits": lists[n], "p": explorer_ref.softmax64(c, t).tolist()}
               for n, c in cases.items() for t in (0.5, 1.0, 1.7)]
    settings = ((1.0, 0, 0.9), (0.7, 0, 0.5), (1.0, 5, 1.0), (1.3, 40, 0.95), (1.0, 9, 0.3), (2.0, 0, 0.999))
    nucleus = [{"name": n, "T": t, "k": k, "top_p": q, "logits": lists[n],
                "kept": explorer_ref.nucleus(explorer_ref.softmax64(c, t), c, k, q).tolist()}
               for n, c in cases.items() for t, k, q in settings]
    nucleus.append({"name": "quarters", "T": 1.0, "k": 0, "top_p": 0.5, "logits": lists["quarters"], "kept": [0, 1]})
    seeds = (0, 1, 1234567, 20261002, 2 ** 63, 2 ** 64 - 1)
    splitmix = []
    for seed in seeds:
        nxt = explorer_ref.splitmix64(seed)
        splitmix.append({"seed": str(seed), "outputs": [str(nxt()) for _ in range(3)], "u": explorer_ref.uniform(seed)})
    sample = []
    for n in ("peaked", "flat", "ties"):
        c = cases[n]
        for t, k, q in ((1.0, 0, 0.9), (1.7, 0, 1.0), (0.8, 20, 0.95)):
            p = explorer_ref.softmax64(c, t)
            kept = explorer_ref.nucleus(p, c, k, q)
            for seed in seeds:
                u = explorer_ref.uniform(seed)
                sample.append({"name": n, "T": t, "k": k, "top_p": q, "logits": lists[n], "u": u,
                               "id": explorer_ref.inverse_cdf(p, kept, u)})
    greedy = [{"name": n, "logits": lists[n], "id": int(np.argmax(c))} for n, c in cases.items()]
    return {"softmax": softmax, "nucleus": nucleus, "greedy": greedy, "splitmix": splitmix, "sample": sample,
            "decode": _decode(cases["peaked"]), "settings": _settings()}


def _decode(rec: np.ndarray) -> list[dict]:
    """The page's embedded arrays, made by explorer.py's own encoders; values as numbers ("NaN" for NaN)."""
    def values(x):
        return ["NaN" if np.isnan(v) else float(v) for v in np.asarray(x, dtype=np.float64)]
    out = [{"name": "logits", "encoding": "floats", "b64": explorer.b64_floats(rec), "values": values(rec)}]
    encoding, b64 = explorer.logits_encoding(rec)
    assert encoding == "bf16"
    out.append({"name": "record", "encoding": encoding, "n": int(rec.size), "b64": b64, "values": values(rec)})
    ids = np.array([0, 3, 8, 9, 17, 4095])
    mask = np.zeros(rec.size)
    mask[ids] = 1
    out.append({"name": "kept", "encoding": "bits", "n": int(rec.size), "b64": explorer.b64_bits(ids, rec.size),
                "values": mask.tolist()})
    near = rec.copy()                    # a bf16 step off at every 5th id, a sign flip (escaped) and -0
    near[::5] = _bf16(np.nextafter(near[::5], np.float32(np.inf)) + np.abs(near[::5]) / 100)
    near[[11, 12]] = [-rec[11], -0.0]
    with np.errstate(over="ignore"):
        variants = {"bf16": _bf16(np.random.default_rng(3).normal(0, 30, rec.size)),       # unrelated: plain bf16
                    "f16": (-rec[::-1] * 7).astype("<f2").astype("<f4"), "f4": -rec[::-1] / np.float32(3),
                    "rice": near}
    variants["f16"][5] = np.nan
    for want, v in variants.items():
        encoding, b64, params = explorer.variant_encoding(rec, v)
        assert encoding == want, (encoding, want)
        out.append({"name": f"variant {want}", "encoding": encoding, "n": int(rec.size), "b64": b64,
                    "params": params, "values": values(v)})
    return out


def _settings() -> list[dict]:
    good = (("1", "0", "1"), ("0", "0", "1"), ("0.7", "40", "0.9"), ("2", "3", "0.01"))
    bad = (("-1", "0", "1"), ("", "0", "1"), ("abc", "0", "1"), ("1", "-2", "1"), ("1", "2.5", "1"),
           ("1", "0", "1.5"), ("1", "0", "0"), ("1", "0", ""), ("Infinity", "0", "1"))
    return [{"raw": list(r), "error": False} for r in good] + [{"raw": list(r), "error": True} for r in bad]


@pytest.mark.skipif(NODE is None, reason="no node: apt-get install nodejs (the JS unit tests run under Node's "
                                         "test runner)")
def test_the_page_s_numerics_equal_the_python_reference_and_mutants_fail(tmp_path):
    path = tmp_path / "fixtures.json"
    path.write_text(json.dumps(fixtures()))
    proc = subprocess.run([NODE, "--test", "--test-reporter=tap", str(REPO / "tests/js/numerics.test.mjs")],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"NEXTTOKEN_JS_FIXTURES": str(path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "# fail 0" in proc.stdout and "# pass 18" in proc.stdout, proc.stdout[-2000:]
