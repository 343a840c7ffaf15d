"""Sharding: the logical-axis table, and the same losses on every mesh (fake CPU devices in
a subprocess) and over two processes."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from bam_configs.training import MeshConfig
from bam_train.sharding import logical_to_spec, make_mesh
from tests.support import REPO_ROOT, host_device_flags
from tests.support.host_devices import host_devices_result, run_on_host_devices
from tests.support.train_runs import free_port

REPO = str(REPO_ROOT)


class _FakeMesh:
    def __init__(self, **shape):
        self.shape = shape


def test_logical_rules_map_names_to_mesh_axes():
    mesh = _FakeMesh(data=2, fsdp=2, tensor=2)
    assert logical_to_spec(("embed", "q_heads"), (64, 64), mesh) == PartitionSpec("fsdp", "tensor")
    assert logical_to_spec(("vocab", "embed"), (32768, 64), mesh) == PartitionSpec("tensor", "fsdp")
    assert logical_to_spec(("norm",), (64,), mesh) == PartitionSpec(None)
    assert logical_to_spec((None,), (4,), mesh) == PartitionSpec(None)
    # An axis that does not divide the dimension is left out (a 259-token byte vocabulary).
    assert logical_to_spec(("vocab", "embed"), (259, 64), mesh) == PartitionSpec(None, "fsdp")


def test_single_device_mesh_and_errors():
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    with pytest.raises(ValueError, match="logical axis 'heads' has no rule"):
        logical_to_spec(("heads",), (4,), mesh)


EQUIVALENCE = """
import dataclasses, json, sys
import jax
from bam_configs.presets import preset
from bam_configs.training import MeshConfig
from bam_train.data import train_iterator
from bam_train.setup import build

cfg = preset("micro").replace(batch_size=8, steps=3)
cfg = cfg.replace(data=dataclasses.replace(cfg.data, passkey_loss="all"))

def losses(mesh, devices):
    setup = build(cfg.replace(mesh=MeshConfig(*mesh)), devices)
    state = setup.init()
    data = train_iterator(cfg.data, cfg.seq_len, cfg.seed, setup.layout())
    out = []
    for _ in range(cfg.steps):
        batch = setup.global_batch(next(data))
        state, metrics = setup.train_step(state, batch, setup.step_values)
        out.append(float(metrics["loss"]))
    return out

result = {"1,1,1": losses((1, 1, 1), jax.devices()[:1])}
for mesh in [(8, 1, 1), (2, 2, 2), (1, 4, 2)]:
    result[",".join(map(str, mesh))] = losses(mesh, jax.devices())
print("RESULT" + json.dumps(result))
"""


@pytest.mark.slow
def test_meshes_give_the_same_losses_as_one_device():
    result = host_devices_result(textwrap.dedent(EQUIVALENCE), devices=8, timeout=600)
    reference = np.asarray(result.pop("1,1,1"))
    assert len(reference) == 3 and np.all(np.isfinite(reference))
    for mesh, losses in result.items():
        np.testing.assert_allclose(losses, reference, rtol=1e-5, err_msg=f"mesh {mesh}")


def _train_args(workdir: str) -> list[str]:
    return [
        "--config=micro",
        f"--workdir={workdir}",
        "--config.steps=4",
        "--config.batch_size=4",
        "--config.log_every=1",
        "--config.checkpoint_every=2",
        "--config.data.passkey_loss=all",
    ]


def _losses(workdir: str) -> list[float]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


@pytest.mark.slow
def test_two_processes_match_one_and_their_checkpoint_restores(tmp_path):
    multi, single = str(tmp_path / "multi"), str(tmp_path / "single")
    port = free_port()
    env = {
        **os.environ,
        "XLA_FLAGS": host_device_flags(2),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": REPO,
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bam_train",
                *_train_args(multi),
                f"--coordinator=localhost:{port}",
                "--num_processes=2",
                f"--process_id={i}",
            ],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outputs)
    single_env = {**env, "XLA_FLAGS": host_device_flags(4)}
    proc = subprocess.run(
        [sys.executable, "-m", "bam_train", *_train_args(single)],
        env=single_env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    np.testing.assert_allclose(_losses(multi), _losses(single), rtol=1e-5)
    assert len(_losses(multi)) == 4
    compare = f"""
        import numpy as np, jax
        from bam_jax.io.checkpoints import load_model
        from bam_train.state import ModelParts
        params = []
        for workdir in ({multi!r}, {single!r}):
            config, model = load_model(workdir)
            params.append(jax.tree.leaves(ModelParts.from_config(config)[0].split(model)[0]))
        for a, b in zip(*params, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
        print("RESTORED", len(params[0]))
    """
    assert (
        "RESTORED" in run_on_host_devices(textwrap.dedent(compare), devices=1, timeout=600).stdout
    )
