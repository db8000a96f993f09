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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nexttoken", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compose", help="compose conf/ (+ Hydra overrides) into params.yaml")
    c.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=tiny_qwen2 prompt.text=...")
    c.add_argument("--check", action="store_true",
                   help="exit 1 (naming the keys) when params.yaml differs from conf/")
    c.set_defaults(func=_compose)
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
