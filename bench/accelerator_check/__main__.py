"""`python -m bench.accelerator_check`."""

import sys

from bench.accelerator_check.cli import main

sys.exit(main())
