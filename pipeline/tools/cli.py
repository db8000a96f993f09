"""The `nexttoken` command: compose the config, audit, verify, diff, sweep, bench."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

from pipeline.errors import EXIT_USER_ERROR, UserError
from pipeline.store import paths

EXIT_BROKEN_PIPE = 128 + 13      # SIGPIPE


def _compose(args: argparse.Namespace) -> int:
    from pipeline.config import compose, schema
    root = Path.cwd()
    params_file = root / paths.PARAMS
    if args.check:
        if args.overrides or any(v is not None for v in (args.prompt, args.prompt_file, args.prompt_set)):
            raise UserError("--check takes no overrides (nor --prompt / --prompt-file / --prompt-set): it composes "
                            "conf/ with the recorded ones")
        differing, overrides = compose.check(root, params_file)
        how = f"`nexttoken compose{''.join(' ' + shlex.quote(o) for o in overrides)}`"
        if differing:
            print(f"params.yaml differs from {how} (the overrides recorded in {compose.RECORD}) at: "
                  f"{', '.join(differing)}\n"
                  f"conf/ was edited since, or params.yaml was changed another way (by hand, or by `dvc exp run "
                  f"-S`): run {how} to rewrite it, or `nexttoken compose OVERRIDES` for other ones", file=sys.stderr)
            return 1
        print(f"params.yaml matches {how}")
        return 0
    overrides = compose.prompt_overrides(args.overrides, args.prompt, args.prompt_file, root, args.prompt_set)
    params = compose.compose(overrides, root, params_file, prompt_text=args.prompt)
    prompt = schema.load_section(params, "prompt", root)
    print(f"wrote {paths.PARAMS}: model={params['model']['name']} prompt={prompt.name}")
    # what this command added to the overrides for the prompt (DVC's own composition adds nothing): for `dvc exp run`
    added = compose.with_prompt_source(overrides)[len(args.overrides):]
    if added:
        print("the same for dvc: dvc exp run " + " ".join(f"-S {compose.shell_word(ov)}" for ov in added))
    return 0


def _audit(args: argparse.Namespace) -> int:
    from pipeline.tools import audit
    return audit.cli(args)


def _diff(args: argparse.Namespace) -> int:
    from pipeline.tools import rundiff
    return rundiff.cli(args)


def _verify(args: argparse.Namespace) -> int:
    from pipeline.tools import verify  # imports no torch: verify pins the kernels first
    return verify.cli(args)


def _sweep(args: argparse.Namespace) -> int:
    from pipeline.tools import sweep
    return sweep.cli(args)


def _bench(bench_args: list[str]) -> int:
    """`python -m bench ARGS` in this checkout: the bench measures code, so it lives beside the
    code (bench/) and is not part of the installed package."""
    root = Path.cwd()
    if not (root / "bench" / "__main__.py").is_file() or not (root / "pipeline").is_dir():
        raise UserError(f"nexttoken bench runs in a checkout of the nexttoken repository (with bench/ and "
                        f"pipeline/), not in {root}: cd there and run it again (or `make bench`)")
    return subprocess.call([sys.executable, "-m", "bench", *bench_args], cwd=root)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, like every other nexttoken error (exit 2).

    Subcommand parsers are built from the same class, so they inherit this.
    """

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="nexttoken", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compose", help="compose conf/ (+ Hydra overrides) into params.yaml")
    c.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=tiny_qwen2 prompt.text=...")
    c.add_argument("--check", action="store_true",
                   help="exit 1 (naming the keys) when params.yaml differs from conf/ composed with the "
                        "overrides `nexttoken compose` recorded")
    given = c.add_mutually_exclusive_group()
    given.add_argument("--prompt", metavar="TEXT",
                       help="the prompt, verbatim (any characters: quoted for Hydra here); its name is derived "
                            "from it unless prompt.name=NAME is given")
    given.add_argument("--prompt-file", metavar="PATH",
                       help="a UTF-8 file under prompts/ holding the prompt (sets prompt.file, prompt.text=null)")
    given.add_argument("--prompt-set", metavar="PATH",
                       help="a prompt set, prompts/<name>.jsonl (sets prompt.set, prompt.text=null, prompt.file=null)")
    c.set_defaults(func=_compose)
    b = sub.add_parser("bench", help="(in a checkout) measure what recording costs, as ratios with targets: "
                                     "`nexttoken bench --help` lists the sections", add_help=False)
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to `python -m bench`")
    a = sub.add_parser("audit", help="re-verify a run: hashes, chain, dvc.lock, config, re-derivation "
                                     "(exit 1 on any finding)")
    a.add_argument("--rev", help="a git revision or experiment name, read from git + the DVC cache "
                                 "(default: the workspace)")
    a.set_defaults(func=_audit)
    d = sub.add_parser("diff", help="how two runs differ: config, environment, numbers, trajectories")
    d.add_argument("rev_a", help="a git revision, an experiment name or 'workspace'")
    d.add_argument("rev_b", help="a git revision, an experiment name or 'workspace'")
    d.set_defaults(func=_diff)
    v = sub.add_parser("verify", help="re-run a past run here from its config and snapshot; compare bit for bit "
                                      "and explain any difference (exit 1 when anything differs)")
    v.add_argument("--rev", help="a git revision or experiment name, read from git + the DVC cache "
                                 "(default: the workspace)")
    v.add_argument("--stages", nargs="+", metavar="STAGE",
                   help="re-run only these (and any between them): forward, logits, probs, trajectories, checks")
    v.set_defaults(func=_verify)
    s = sub.add_parser("sweep", help="collect the current baseline's experiments into a table and plots")
    s.add_argument("--out", type=Path, default=None, help="output folder (default: artifacts/sweep)")
    s.set_defaults(func=_sweep)
    g = sub.add_parser("dvc-yaml", help="(in a checkout) write dvc.yaml from the stage declarations "
                                        "(pipeline/store/graph.py) and the stages' imports")
    g.add_argument("--check", action="store_true", help="write nothing; exit 1 when dvc.yaml is not what they give")
    g.set_defaults(func=_dvc_yaml)
    sh = sub.add_parser("screenshot", help="a PNG of the explorer page, in headless Chromium with no network "
                        "(needs chromium, chromium-driver and selenium)")
    sh.add_argument("page", nargs="?", default="artifacts/report/explorer.html", help="the page (default: %(default)s)")
    sh.add_argument("--out", default=None, help="the PNG (default: beside the page, explorer.png)")
    sh.set_defaults(func=_screenshot)
    return p


def _dvc_yaml(args) -> int:
    from pipeline.tools import dvc_yaml
    return dvc_yaml.cli(args)


def _screenshot(args) -> int:
    from pipeline.tools import screenshot
    return screenshot.cli(args)


def main(argv: list[str] | None = None) -> int:
    """The command's exit status. A reader that stops early (`nexttoken diff a b | head`) ends it quietly, with
    the status a shell gives a process killed by SIGPIPE (141), instead of a BrokenPipeError traceback."""
    try:
        try:
            return _command(sys.argv[1:] if argv is None else list(argv))
        finally:
            sys.stdout.flush()       # here, where the error can be caught, not at the interpreter's exit
    except BrokenPipeError:
        # Python's advice: point stdout at devnull, or the exit's own flush fails a second time
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _command(argv: list[str]) -> int:
    try:
        if argv[:1] == ["bench"]:        # every argument after it is the bench's own
            return _bench(argv[1:])
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra and args.command == "compose" and not any(e.startswith("-") for e in extra):
            args.overrides += extra       # overrides after an option: `compose model=x --prompt T sampling.top_k=5`
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return args.func(args)
    except UserError as e:
        print(f"nexttoken {argv[0] if argv else ''}: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
