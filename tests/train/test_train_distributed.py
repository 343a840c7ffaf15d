"""How bam-train starts several processes: explicit flags, jax's cluster detection, or none."""

import jax
import pytest

from bam_train import cli, distributed
from bam_train.peers import DEFAULT_PEER_TIMEOUT_S

HEARTBEAT = {"heartbeat_timeout_seconds": DEFAULT_PEER_TIMEOUT_S}


def flags_for(*extra: str):
    _, flag_values = cli.parse_args(["bam-train", "--config=micro", "--workdir=/tmp/x", *extra])
    return flag_values


@pytest.mark.parametrize(
    ("extra", "environ", "expected"),
    [
        ((), {}, "off"),
        ((), {"SLURM_NTASKS": "1"}, "off"),
        ((), {"SLURM_NTASKS": "16"}, "cluster"),
        ((), {"OMPI_COMM_WORLD_SIZE": "4"}, "cluster"),
        ((), {"TPU_WORKER_HOSTNAMES": "t1v-0,t1v-1"}, "cluster"),
        ((), {"TPU_WORKER_HOSTNAMES": "localhost"}, "off"),
        (("--distributed=off",), {"SLURM_NTASKS": "16"}, "off"),
        (("--distributed=cluster",), {}, "cluster"),
        (("--coordinator=h:1", "--num_processes=2", "--process_id=1"), {}, "explicit"),
        (
            ("--coordinator=h:1", "--num_processes=2", "--process_id=0"),
            {"SLURM_NTASKS": "16"},
            "explicit",
        ),
    ],
)
def test_distributed_mode(extra, environ, expected):
    assert distributed.distributed_mode(flags_for(*extra), environ) == expected


def test_cluster_mode_lets_jax_detect_the_cluster(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setenv("SLURM_NTASKS", "8")
    distributed.initialize_distributed(flags_for("--cpu_collectives=none"))
    assert calls == [((), HEARTBEAT)]


def test_explicit_flags_are_passed_on(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    extra = ("--coordinator=h:1", "--num_processes=2", "--process_id=1", "--cpu_collectives=none")
    distributed.initialize_distributed(flags_for(*extra))
    explicit = {"coordinator_address": "h:1", "num_processes": 2, "process_id": 1}
    assert calls == [((), {**explicit, **HEARTBEAT})]


def test_unknown_distributed_mode_is_one_line(capsys):
    assert cli.run(["bam-train", "--config=micro", "--workdir=/tmp/x", "--distributed=yes"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "distributed" in err and "Traceback" not in err
