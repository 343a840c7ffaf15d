"""The examples under examples/ run as a user runs them and show what they say (slow: the
default suite runs the same calls in tests/project/test_library_doc.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT

REPO = str(REPO_ROOT)


@pytest.mark.slow
def test_own_decoders_train_their_priors_on_four_devices():
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, os.path.join("examples", "own_decoder.py"), "--steps", "40"],
        env={**env, "JAX_PLATFORMS": "cpu"},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.startswith("4 devices, batch of 32 split over P('data',)"), proc.stdout
    rows = re.findall(
        r"^(nnx|linen): copy loss ([\d.]+) -> ([\d.]+) in 40 steps; theta_alpha moved by up to "
        r"([\d.]+)$",
        proc.stdout,
        flags=re.MULTILINE,
    )
    assert [row[0] for row in rows] == ["nnx", "linen"], proc.stdout
    for _, first, last, moved in rows:
        assert float(last) < float(first), proc.stdout
        assert float(moved) > 1e-3, proc.stdout
