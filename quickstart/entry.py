"""The `bam-quickstart` command: checks the training and evaluation extras are installed, then
runs bam_quickstart.run."""

from __future__ import annotations

import importlib

from bam_jax.extras import require_extras


def main() -> int:
    require_extras("bam-quickstart", ["train", "eval"])
    return importlib.import_module("bam_quickstart.run").main()
