"""One thin entry point per DVC stage, run as `python -m stages.<name>`.

Run so, Ctrl-C is one line from the first moment: `python -m` imports this package before
the stage module, whose imports (torch, transformers) take seconds, so the handler is set
here. It prints the stage's line and exits with status 130; `stage_main` then puts the
default handler back, so a stage interrupted at work removes its staging folder on the way out.
"""

import signal
import sys

from pipeline.errors import interrupted


def _quiet_exit(stage: str):
    def handler(signum, frame):
        print(interrupted(stage), file=sys.stderr)
        raise SystemExit(130)     # no traceback: SystemExit ends the import quietly
    return handler


# While `python -m` locates the module, sys.argv[0] is "-m" (documented); a test or tool that
# merely imports a stage keeps its own handler.
if sys.argv[:1] == ["-m"] and "-m" in sys.orig_argv[:-1]:
    _module = sys.orig_argv[sys.orig_argv.index("-m") + 1]
    if _module.startswith(__name__ + "."):
        signal.signal(signal.SIGINT, _quiet_exit(_module.split(".", 1)[1]))
