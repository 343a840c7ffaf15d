"""`python -m bam_eval` (and `python -m eval` in a checkout's root) is `bam-eval`."""

import sys

from bam_eval.cli import main

sys.exit(main())
