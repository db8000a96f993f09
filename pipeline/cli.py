"""The `nexttoken` command: compose the config, and (as they land) audit, diff, sweep, bench."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline import paths
from pipeline.errors import EXIT_USER_ERROR, UserError


def _compose(args: argparse.Namespace) -> int:
    from pipeline import compose
    root = Path.cwd()
    params_file = root / paths.PARAMS
    if args.check:
        if args.overrides:
            raise UserError("--check takes no overrides: it compares params.yaml with conf/ as committed")
        differing = compose.check(root, params_file)
        if differing:
            print(f"params.yaml differs from the composition of conf/ at: {', '.join(differing)}\n"
                  f"run `nexttoken compose` to rewrite it", file=sys.stderr)
            return 1
        print("params.yaml matches conf/")
        return 0
    params = compose.compose(args.overrides, root, params_file)
    print(f"wrote {paths.PARAMS}: model={params['model']['name']} prompt={params['prompt']['name']}")
    return 0


def _audit(args: argparse.Namespace) -> int:
    from pipeline import audit
    return audit.cli(args)


def _diff(args: argparse.Namespace) -> int:
    from pipeline import rundiff
    return rundiff.cli(args)


def _sweep(args: argparse.Namespace) -> int:
    from pipeline import sweep
    return sweep.cli(args)


def _bench(args: argparse.Namespace) -> int:
    from pipeline import bench    # torch and friends load only when benchmarking
    lengths = tuple(args.lengths) if args.lengths else None
    wl = tuple(args.workspace_lengths) if args.workspace_lengths else None
    result = bench.run(Path.cwd(), quick=args.quick, only=args.only, lengths=lengths, workspace_lengths=wl)
    print(bench.report(result))
    print(f"wrote {bench.OUTPUT.as_posix()} ({result['wall_s']:.0f} s)")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, like every other nexttoken error (exit 2).

    Subcommand parsers are built from the same class, so they inherit this.
    """

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="nexttoken", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compose", help="compose conf/ (+ Hydra overrides) into params.yaml")
    c.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=tiny_qwen2 prompt.text=...")
    c.add_argument("--check", action="store_true",
                   help="exit 1 (naming the keys) when params.yaml differs from conf/")
    c.set_defaults(func=_compose)
    b = sub.add_parser("bench", help="measure capture, files, chain, isolation and scale as ratios "
                                     "-> artifacts/bench/bench.json")
    b.add_argument("--quick", action="store_true", help="few repetitions, short prompts (for tests)")
    b.add_argument("--only", metavar="NAME", help="one section: capture, logits_io, chain, nnsight, dvc, scale")
    b.add_argument("--lengths", type=int, nargs="+", metavar="T", help="scale lengths for tiny_qwen2")
    b.add_argument("--workspace-lengths", type=int, nargs="+", metavar="T",
                   help="scale lengths for this workspace's model")
    b.set_defaults(func=_bench)
    a = sub.add_parser("audit", help="re-verify a run: hashes, chain, dvc.lock, config, re-derivation "
                                     "(exit 1 on any finding)")
    a.add_argument("--rev", help="a git revision or experiment name, read from git + the DVC cache "
                                 "(default: the workspace)")
    a.set_defaults(func=_audit)
    d = sub.add_parser("diff", help="how two runs differ: config, environment, numbers, trajectories")
    d.add_argument("rev_a", help="a git revision, an experiment name or 'workspace'")
    d.add_argument("rev_b", help="a git revision, an experiment name or 'workspace'")
    d.set_defaults(func=_diff)
    s = sub.add_parser("sweep", help="collect the current baseline's experiments into a table and plots")
    s.add_argument("--out", type=Path, default=None, help="output folder (default: artifacts/sweep)")
    s.set_defaults(func=_sweep)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"nexttoken {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
