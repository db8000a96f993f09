"""`python -m pipeline ...` is `nexttoken ...`."""

import sys

from pipeline.tools.cli import main

sys.exit(main())
