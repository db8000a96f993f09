"""`python -m bench` (also `nexttoken bench` and `make bench` in a checkout): every ratio with its target.

Measures this workspace's model (artifacts/prepare_model, default gemma3_270m) and writes
artifacts/bench/bench.json; see bench/bench.py for the sections.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.errors import EXIT_USER_ERROR, UserError
from pipeline.tools.cli import OneLineParser


def main(argv: list[str] | None = None) -> int:
    from bench import bench
    p = OneLineParser(prog="nexttoken bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="few repetitions, short prompts (for tests)")
    p.add_argument("--only", metavar="NAME", help="one section: " + ", ".join(bench.SECTIONS))
    p.add_argument("--lengths", type=int, nargs="+", metavar="T", help="scale lengths for tiny_qwen2")
    p.add_argument("--workspace-lengths", type=int, nargs="+", metavar="T",
                   help="scale lengths for this workspace's model (capture.positions=all)")
    p.add_argument("--last-lengths", type=int, nargs="+", metavar="T",
                   help="scale lengths for this workspace's model with capture.positions=last")
    p.add_argument("--sizes", type=int, nargs="+", metavar="N", help="set sizes of the sets section")
    p.add_argument("--ray", action="store_true", help="the sets section also on executor=ray (2 local workers)")
    args = p.parse_args(argv)
    try:
        result = bench.run(Path.cwd(), quick=args.quick, only=args.only,
                           lengths=tuple(args.lengths) if args.lengths else None,
                           workspace_lengths=tuple(args.workspace_lengths) if args.workspace_lengths else None,
                           last_lengths=tuple(args.last_lengths) if args.last_lengths else None,
                           set_sizes=tuple(args.sizes) if args.sizes else None, set_ray=args.ray)
    except UserError as e:
        print(f"nexttoken bench: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(bench.report(result))
    print(f"wrote {bench.OUTPUT.as_posix()} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
