"""`python -m eval` is `bam-eval`."""

import sys

from eval.cli import main

sys.exit(main())
