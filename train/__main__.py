"""`python -m bam_train` (and `python -m train` in a checkout's root): the same as `bam-train`."""

from bam_train.cli import main

main()
