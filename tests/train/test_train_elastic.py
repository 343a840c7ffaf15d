"""Elastic resume: a checkpoint written on one mesh resumes on another mesh and on another
number of processes (fake CPU devices in subprocesses), and the steps after it give the
losses of a run that never moved."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from bam_configs.presets import preset
from bam_train.data import BatchLayout, train_iterator
from tests.support import REPO_ROOT, host_device_flags
from tests.support.train_runs import free_port

REPO = str(REPO_ROOT)
SAVED_STEP, STEPS = 2, 4


def _env(devices: int) -> dict[str, str]:
    return {
        **os.environ,
        "XLA_FLAGS": host_device_flags(devices),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": REPO,
    }


def _train_command(workdir: str, mesh: tuple[int, int, int]) -> list[str]:
    data, fsdp, tensor = mesh
    return [
        sys.executable,
        "-m",
        "bam_train",
        "--config=micro",
        f"--workdir={workdir}",
        f"--config.steps={STEPS}",
        "--config.batch_size=8",
        "--config.log_every=1",
        f"--config.checkpoint_every={SAVED_STEP}",
        "--config.data.passkey_loss=all",
        f"--config.mesh.data={data}",
        f"--config.mesh.fsdp={fsdp}",
        f"--config.mesh.tensor={tensor}",
    ]


def _train(workdir: str, mesh: tuple[int, int, int]) -> None:
    proc = subprocess.run(
        _train_command(workdir, mesh),
        env=_env(8),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _train_two_processes(workdir: str, mesh: tuple[int, int, int]) -> None:
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                *_train_command(workdir, mesh),
                f"--coordinator=localhost:{port}",
                "--num_processes=2",
                f"--process_id={i}",
            ],
            env=_env(4),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)


def _losses(workdir: str) -> dict[int, float]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.fixture(scope="module")
def unmoved_run(tmp_path_factory) -> str:
    """All steps on one process with mesh (8, 1, 1), a checkpoint every SAVED_STEP steps."""
    workdir = str(tmp_path_factory.mktemp("unmoved") / "run")
    _train(workdir, (8, 1, 1))
    return workdir


def _copy_at_saved_step(unmoved_run: str, target: str) -> str:
    """The unmoved run as it was after its checkpoint of SAVED_STEP."""
    shutil.copytree(unmoved_run, target)
    shutil.rmtree(os.path.join(target, "checkpoints", str(STEPS)))
    return target


def _assert_same_losses_after_resume(moved: str, unmoved: str) -> None:
    moved_losses, unmoved_losses = _losses(moved), _losses(unmoved)
    assert sorted(moved_losses) == list(range(1, STEPS + 1))
    resumed = range(SAVED_STEP + 1, STEPS + 1)
    after_move = np.asarray([moved_losses[s] for s in resumed])
    unmoved_after = np.asarray([unmoved_losses[s] for s in resumed])
    print(f"losses after the move {after_move.tolist()}, unmoved {unmoved_after.tolist()}")
    np.testing.assert_allclose(after_move, unmoved_after, rtol=1e-5)


def test_each_resumed_process_reads_its_rows_of_the_one_process_batch():
    cfg = preset("micro")
    data = dataclasses.replace(cfg.data, passkey_loss="all")

    def batch_after_resume(layout: BatchLayout) -> dict:
        iterator = train_iterator(data, cfg.seq_len, cfg.seed, layout)
        iterator.set_state({"next_index": SAVED_STEP})
        return next(iterator)

    whole = batch_after_resume(BatchLayout(accum_steps=1, batch_size=8))
    halves = [batch_after_resume(BatchLayout(1, 8, row_start, 4)) for row_start in (0, 4)]
    for key, rows in whole.items():
        np.testing.assert_array_equal(np.concatenate([h[key] for h in halves], axis=1), rows)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [(2, 2, 2), (1, 4, 2)])
def test_resume_on_another_mesh_gives_the_unmoved_losses(unmoved_run, tmp_path, mesh):
    moved = _copy_at_saved_step(unmoved_run, str(tmp_path / "run"))
    _train(moved, mesh)
    _assert_same_losses_after_resume(moved, unmoved_run)


@pytest.mark.slow
def test_resume_on_two_processes_gives_the_unmoved_losses(unmoved_run, tmp_path):
    moved = _copy_at_saved_step(unmoved_run, str(tmp_path / "run"))
    _train_two_processes(moved, (8, 1, 1))
    _assert_same_losses_after_resume(moved, unmoved_run)
