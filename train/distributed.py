"""How `bam-train` starts several processes: the mode (explicit flags, jax's cluster
detection, or none), `jax.distributed` with the peer heartbeat timeout, and the waiting for
the runtime's verdict when a peer is lost (bam_train.peers)."""

from __future__ import annotations

import contextlib
import os

from absl import flags

from bam_train.peers import RunPlace, await_runtime_verdict, is_peer_failure

DISTRIBUTED_MODES = ("auto", "cluster", "off")

# Process counts that jax's cluster detection reads, by scheduler.
CLUSTER_PROCESS_COUNTS = {
    "Slurm": "SLURM_NTASKS",
    "Open MPI": "OMPI_COMM_WORLD_SIZE",
}


def distributed_mode(flag_values: flags.FlagValues, environ: dict[str, str]) -> str:
    """How to start: "explicit" (the flags), "cluster" (jax detects the cluster) or "off"."""
    if flag_values.distributed == "off":
        return "off"
    if flag_values.distributed == "cluster":
        return "cluster"
    if flag_values.num_processes > 1:
        return "explicit"
    if detected_cluster(environ) is not None:
        return "cluster"
    return "off"


def detected_cluster(environ: dict[str, str]) -> str | None:
    """The scheduler that started several processes of this job, if any."""
    for name, variable in CLUSTER_PROCESS_COUNTS.items():
        if environ.get(variable, "1").strip() not in ("", "0", "1"):
            return name
    if "," in environ.get("TPU_WORKER_HOSTNAMES", ""):
        return "TPU pod"
    return None


def initialize_distributed(flag_values: flags.FlagValues) -> None:
    mode = distributed_mode(flag_values, dict(os.environ))
    if mode == "off":
        return
    import jax

    if flag_values.cpu_collectives != "none":
        jax.config.update("jax_cpu_collectives_implementation", flag_values.cpu_collectives)
    heartbeat = {"heartbeat_timeout_seconds": flag_values.peer_timeout}
    if mode == "cluster":
        jax.distributed.initialize(**heartbeat)
        return
    jax.distributed.initialize(
        coordinator_address=flag_values.coordinator,
        num_processes=flag_values.num_processes,
        process_id=flag_values.process_id,
        **heartbeat,
    )


def run_place(flag_values: flags.FlagValues, mode: str) -> RunPlace:
    if mode != "explicit":
        return RunPlace(flag_values.workdir)
    return RunPlace(flag_values.workdir, flag_values.process_id, flag_values.num_processes)


@contextlib.contextmanager
def peer_failures_wait_for_the_runtime(mode: str, flag_values: flags.FlagValues):
    """A multi-process run's error that a lost peer caused waits for the runtime to name
    the peer (bam_train.peers) instead of being printed."""
    try:
        yield
    except Exception as err:
        if mode == "off" or not is_peer_failure(err):
            raise
        await_runtime_verdict(err, flag_values.peer_timeout, flag_values.debug)
