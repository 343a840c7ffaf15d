"""A lost process of a multi-process run ends every other process within --peer_timeout
seconds, with one line naming it and the last complete checkpoint and exit status 75, and
the same command on every process resumes from that checkpoint exactly."""

import json
import logging
import os
import re
import signal
import sys
import textwrap
import time

import pytest

from bam_train import peers
from tests.support.train_runs import metric_steps, start_two_processes, wait_for

PEER_TIMEOUT_S = 4
# What jax's runtime writes before it aborts a survivor: when the coordinator is lost, and
# when another process's heartbeats stopped (abridged from real runs).
COORDINATOR_LOST = [
    "W1207 06:51:02.623928   25444 preemption_sync_manager.cc:147] Failed to retrieve "
    "preemption notice from coordination service: UNAVAILABLE: Socket closed\n",
    "E1207 06:51:02.624041   25444 coordination_service_agent.cc:289] Polled an error from "
    "coordination service (this can be an error from this or another task).\n",
    "F1207 06:51:02.624070   25444 client.h:80] Terminating process because the JAX "
    "distributed service detected fatal errors.\n",
]
HEARTBEATS_STOPPED = [
    "E1207 06:51:31.944071   25714 coordination_service.cc:1549] [37255] Use error polling to "
    "propagate the following error to all tasks: UNAVAILABLE: The following tasks are "
    "unhealthy (stopped sending heartbeats):\n",
    "1\n",
    "The tasks have crashed. Check the task logs for an earlier error.\n",
    "*** Check failure stack trace: ***\n",
    "    @     0x7fe33c440634  absl::lts_20260107::log_internal::LogMessage::SendToLog()\n",
]


@pytest.mark.parametrize(
    ("report", "process_id", "expected"),
    [
        (COORDINATOR_LOST, 1, "process 0 (the coordinator)"),
        (HEARTBEATS_STOPPED, 0, "process 1"),
        (["E1207 ... Task 3 heartbeat timeout. Task 2 heartbeat timeout\n"], 0, "processes 2, 3"),
        (COORDINATOR_LOST, 0, "another process"),
    ],
)
def test_the_runtime_report_names_the_lost_process(report, process_id, expected):
    assert peers.lost_process(report, process_id) == expected


def test_only_the_distributed_runtime_lines_start_a_report():
    assert peers.is_runtime_report(COORDINATOR_LOST[0])
    assert peers.is_runtime_report(HEARTBEATS_STOPPED[0])
    assert not peers.is_runtime_report("W1207 06:51:31.944071   25714 cpu_client.cc:12] slow\n")
    assert not peers.is_runtime_report("step 5 loss 3.2\n")


def test_a_failed_collective_counts_as_a_peer_failure():
    gloo = "UNKNOWN: Gloo AllGather failed: pair.cc:538] Read error: Connection reset by peer"
    try:
        try:
            raise RuntimeError(gloo)
        except RuntimeError as inner:
            raise ValueError("step failed") from inner
    except ValueError as err:
        assert peers.is_peer_failure(err)
    assert not peers.is_peer_failure(ValueError("config: steps must be >= 1"))


def test_orbax_s_log_of_a_barrier_with_a_lost_peer_is_dropped(caplog, monkeypatch):
    # What orbax's background save thread logs when a peer dies during an asynchronous save.
    absl = logging.getLogger("absl")
    monkeypatch.setattr(absl, "filters", [])
    peers.quiet_peer_failure_reports()
    with caplog.at_level(logging.ERROR):
        for error in (
            TimeoutError("Timed out while waiting for async_write_complete barrier."),
            ValueError("a failure of another kind"),
        ):
            try:
                raise error
            except Exception:
                absl.error("Failed to run 1 Handler Commit operations: %s", error, exc_info=True)
    assert [r.getMessage() for r in caplog.records] == [
        "Failed to run 1 Handler Commit operations: a failure of another kind"
    ]


def _fake_child(report: list[str], status: str) -> list[str]:
    """A child that writes a line of its own, then `report`, then ends with `status`."""
    script = f"""
        import os, sys
        sys.stderr.write("a line of the run\\n")
        sys.stderr.write({"".join(report)!r})
        sys.stderr.flush()
        {status}
    """
    return [sys.executable, "-c", textwrap.dedent(script)]


def _supervise(tmp_path, report, status, debug=False) -> int:
    workdir = tmp_path / "run"
    for step in (10, 20):
        (workdir / "checkpoints" / str(step)).mkdir(parents=True, exist_ok=True)
    (workdir / "checkpoints" / "30.orbax-checkpoint-tmp-1").mkdir(exist_ok=True)
    place = peers.RunPlace(str(workdir), process_id=0, num_processes=2)
    return peers.supervise(["bam-train"], place, debug, command=_fake_child(report, status))


def test_a_survivor_aborted_by_the_runtime_prints_one_line_and_exits_75(tmp_path, capfd):
    status = _supervise(tmp_path, HEARTBEATS_STOPPED, "os.abort()")
    err = capfd.readouterr().err
    assert status == peers.PEER_LOST_STATUS == 75
    assert err.splitlines()[0] == "a line of the run"
    (line,) = err.splitlines()[1:]
    assert line.startswith("bam-train: process 1 of 2 stopped, so this one (process 0) stops")
    assert f"the last complete checkpoint is step 20 in {tmp_path / 'run' / 'checkpoints'}" in line
    assert "restart every process with the same command" in line


def test_debug_lets_the_runtime_report_through(tmp_path, capfd):
    assert _supervise(tmp_path, HEARTBEATS_STOPPED, "os.abort()", debug=True) == 75
    err = capfd.readouterr().err
    assert "Check failure stack trace" in err and err.rstrip().endswith("exit status 75)")


def test_a_child_that_ends_on_its_own_keeps_its_status(tmp_path, capfd):
    assert _supervise(tmp_path, [], "sys.exit(3)") == 3
    assert _supervise(tmp_path, [], "os.kill(os.getpid(), 9)") == 128 + 9
    assert capfd.readouterr().err == "a line of the run\n" * 2


def _kill_and_watch(victim, survivor) -> tuple[float, str]:
    victim.send_signal(signal.SIGKILL)
    killed = time.time()
    _, err = survivor.communicate(timeout=PEER_TIMEOUT_S + 60)
    victim.communicate()
    return time.time() - killed, err


def _checkpoint_in_flight(workdir: str) -> bool:
    directory = os.path.join(workdir, "checkpoints")
    return os.path.isdir(directory) and any("tmp" in name for name in os.listdir(directory))


def _validating(workdir: str, eval_every: int) -> bool:
    """The step record of a validation step is written just before validation runs."""
    steps = metric_steps(workdir)
    return bool(steps) and steps[-1] % eval_every == 0


MOMENTS = {
    "step": ((), lambda workdir: len(metric_steps(workdir)) >= 12),
    "checkpoint": (
        (),
        lambda workdir: len(metric_steps(workdir)) >= 12 and _checkpoint_in_flight(workdir),
    ),
    "validation": (
        ("--config.eval_every=7", "--config.eval_batches=40"),
        lambda workdir: len(metric_steps(workdir)) >= 12 and _validating(workdir, 7),
    ),
}


def _assert_one_clean_line(err: str, victim: int, survivor: int, workdir: str) -> int:
    """The survivor's one line; returns the checkpoint step it names, the newest complete."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    who = "process 0 (the coordinator)" if victim == 0 else f"process {victim}"
    assert lines[0].startswith(f"bam-train: {who} of 2 stopped, so this one (process {survivor})")
    match = re.search(r"the last complete checkpoint is step (\d+) in (\S+):", lines[0])
    assert match, lines[0]
    complete = sorted(int(n) for n in os.listdir(match.group(2)) if n.isdigit())
    assert int(match.group(1)) == complete[-1]
    return int(match.group(1))


def _run_and_kill(tmp_path, victim: int, moment: str, steps: int = 100000):
    extra, reached = MOMENTS[moment]
    workdir = str(tmp_path / "run")
    flags = ("--config.checkpoint_every=5", f"--peer_timeout={PEER_TIMEOUT_S}", *extra)
    procs = start_two_processes(workdir, steps, *flags)
    wait_for(lambda: reached(workdir) or any(p.poll() is not None for p in procs))
    assert all(p.poll() is None for p in procs), procs[0].communicate()[1][-3000:]
    seconds, err = _kill_and_watch(procs[victim], procs[1 - victim])
    survivor = procs[1 - victim]
    print(f"{moment}, process {victim} killed: exit {survivor.returncode} after {seconds:.1f} s")
    assert survivor.returncode == peers.PEER_LOST_STATUS, err[-3000:]
    assert seconds < PEER_TIMEOUT_S + 10
    assert "Traceback" not in err and "Check failure" not in err
    return workdir, _assert_one_clean_line(err, victim, 1 - victim, workdir), flags


# Each starts two trainings (about a minute on two CPU cores), so all are slow.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("victim", "moment"),
    [
        (0, "step"),
        (1, "step"),
        (1, "checkpoint"),
        (0, "checkpoint"),
        (1, "validation"),
        (0, "validation"),
    ],
)
def test_a_lost_process_stops_the_other_cleanly(tmp_path, victim, moment):
    _run_and_kill(tmp_path, victim, moment)


def _losses(workdir: str) -> dict[int, float]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.mark.slow
def test_the_same_command_resumes_from_the_named_checkpoint_exactly(tmp_path):
    steps = 40
    workdir, saved, flags = _run_and_kill(tmp_path, victim=1, moment="checkpoint", steps=steps)
    before = _losses(workdir)
    procs = start_two_processes(workdir, steps, *flags)
    outputs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-3000:]
    assert f"resumed from step {saved} in {workdir}" in outputs[0][0]
    after = _losses(workdir)
    assert sorted(after) == list(range(1, steps + 1))
    replayed = [step for step in before if step > saved]
    assert replayed, "the kill came before any step after the checkpoint"
    assert [after[s] for s in replayed] == [before[s] for s in replayed]
