"""The Pallas kernel's gate and attention throughput: sections a and b of the accelerator check.

One implementation of the gate and the timing (bench/accelerator_check/); this front end
only sets the kernel-centred defaults: 4k-128k tokens and the no-reuse GGD variant beside
the default rows. Any flag of the accelerator check may follow and overrides them.

    python -m bench.pallas_bench --out pallas_bench.md   # GPU/TPU
    python -m bench.pallas_bench --interpret             # CPU sanity run
"""

from __future__ import annotations

import sys

from bench.accelerator_check.cli import main as check_main
from bench.accelerator_check.throughput import DEFAULT_VARIANTS

LENGTHS = (16384, 32768, 65536, 131072, 4096, 8192)  # the most important first
VARIANTS = (*DEFAULT_VARIANTS, "pallas+ggd-noreuse")


def check_arguments(argv: list[str]) -> list[str]:
    """accelerator_check's arguments: its gate and throughput sections with these defaults."""
    interpret = "--interpret" in argv
    defaults = ["--sections", "gate", "throughput", "--variants", *VARIANTS]
    if interpret:
        defaults.append("--smoke")
    else:
        defaults += ["--lengths", *map(str, LENGTHS)]
    return defaults + [arg for arg in argv if arg != "--interpret"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return check_main(check_arguments(list(argv)))


if __name__ == "__main__":
    sys.exit(main())
