"""The `bam-eval` command: checks the evaluation extra is installed, then runs bam_eval.cli."""

from __future__ import annotations

import importlib

from bam_jax.extras import require_extras


def main() -> int:
    require_extras("bam-eval", ["eval"])
    return importlib.import_module("bam_eval.cli").main()
