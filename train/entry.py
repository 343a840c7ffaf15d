"""The `bam-train` command: checks the training extra is installed, then runs bam_train.cli."""

from __future__ import annotations

import importlib

from bam_jax.extras import require_extras


def main() -> None:
    require_extras("bam-train", ["train"])
    importlib.import_module("bam_train.cli").main()
