"""Issue 12's size target, measured: validation code at least 40% shorter than `pipeline/config.py`
at 0286aca plus the checks of the same keys that other modules repeated then (removed since).

Each region below is one of those repeats at 0286aca (read with `git show`, so a clone with that
commit is needed), with the config key it checked again. Prints every region's code lines
(`bench.code_lines`), the baseline's total, the target (60% of it) and today's
`pipeline/config/schema.py`.

    python -m bench.validation_size
"""

import functools
import subprocess
import sys
from pathlib import Path

from bench.code_lines import count

BASE = "0286aca"
CONFIG = "pipeline/config.py"
# (file at BASE, first line, last line, what it checked again that config.py had validated)
REPEATS = [
    ("pipeline/capture.py", 135, 144, "capture.attention_layers (types) and capture.positions: CaptureSpec"),
    ("pipeline/capture.py", 355, 356, "capture.positions again, in _forward"),
    ("pipeline/decode.py", 34, 35, "sampling.max_new_tokens, in _check"),
    ("pipeline/decode.py", 79, 80, "capture.positions, in prefill"),
    ("pipeline/models.py", 29, 29, "model.source.kind's values (KINDS, copied)"),
    ("pipeline/models.py", 35, 37, "model.source.architecture's keys (TINY_ARCH_KEYS, copied)"),
    ("pipeline/models.py", 45, 79, "model.source, all of it: ModelSource"),
    ("pipeline/sampling.py", 27, 50, "sampling.temperature / top_k / top_p: _is_real, _is_int, _check_*"),
    ("pipeline/sampling.py", 58, 59, "sampling.temperature, in the temperature warper"),
    ("pipeline/sampling.py", 74, 75, "sampling.top_k, in the top-k warper"),
    ("pipeline/sampling.py", 108, 109, "sampling.top_p, in the top-p warper"),
    ("pipeline/sampling.py", 130, 133, "sampling.temperature / top_k / top_p, in SamplingSettings"),
    ("pipeline/sampling.py", 209, 211, "probs.temperatures, in probability_table"),
]
NOW = "pipeline/config/schema.py"


@functools.cache      # sampling.py holds seven of the regions: one `git show` each file
def _at_base(path: str) -> list[str]:
    out = subprocess.run(["git", "show", f"{BASE}:{path}"], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"git show {BASE}:{path} failed (a clone with {BASE} is needed): {out.stderr.strip()}")
    return out.stdout.splitlines(keepends=True)


def main() -> None:
    config = count(_at_base(CONFIG))
    print(f"{BASE}:{CONFIG}  {config}")
    repeats = 0
    for path, first, last, what in REPEATS:
        n = count(_at_base(path)[first - 1:last])
        repeats += n
        print(f"{BASE}:{path}:{first}-{last}  {n}  ({what})")
    base = config + repeats
    now = count(Path(NOW).read_text(encoding="utf-8").splitlines(keepends=True))
    print(f"baseline: {config} + {repeats} repeated = {base} code lines; target (40% shorter): <= {0.6 * base:.1f}")
    print(f"now: {NOW} {now} code lines, {1 - now / base:.1%} shorter: {'MET' if now <= 0.6 * base else 'NOT MET'}")


if __name__ == "__main__":
    main()
