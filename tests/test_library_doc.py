"""The python blocks of docs/library.md run as written, in order, in one interpreter on 4
host devices (the snippets of "Use it in your model" build on each other)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIBRARY_DOC = REPO / "docs" / "library.md"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def test_the_library_doc_snippets_run_in_order(tmp_path):
    blocks = PYTHON_BLOCK.findall(LIBRARY_DOC.read_text(encoding="utf-8"))
    assert len(blocks) >= 7, "docs/library.md lost its walk-through (NNX ... x64)"
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.run(
        [sys.executable, "-c", "\n\n".join(blocks)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
