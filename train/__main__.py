"""`python -m train`: the same as `bam-train`."""

from train.cli import main

main()
