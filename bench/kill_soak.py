"""Kill soak: one training killed with SIGKILL at random moments and resumed each time ends
with parameters and optimizer state bit-identical to an uninterrupted run's.

  taskset -c 1 python -m bench.kill_soak --kills=20 --steps=150 --checkpoint_every=5 --seed=0

Both runs are the same `bam-train` command (the quickstart preset by default, `--config`
picks another; asynchronous checkpoints every `--checkpoint_every` steps, the last two
kept) on two workdirs. The soaked run is killed `--kills` times. Each kill comes at or after
a step drawn from `--seed` (spread over the run, sorted), at a moment also drawn:

- startup: a random time within `--startup_s` of the launch (restoring, compiling), or at
  its first step if that comes sooner;
- step: a random fraction of `--step_s` after that step;
- checkpoint: at or after that step, while an asynchronous checkpoint the launch writes is
  still a temporary folder.

Each kill is followed by the same command, which resumes; the last one runs to the end.
The final checkpoints of both runs are then compared array by array, bit for bit, and so
are the losses of every step in their metrics.jsonl.

Prints a table, one row per kill: what the launch was doing, the step it had resumed from,
the newest step it logged, the step the next launch resumed from, the steps lost (logged
but trained again) and the seconds from that restart to its first new step; then the
totals and the comparison. Exit status 1 when the states or losses differ or a launch did
not resume from a checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOMENTS = ("startup", "step", "checkpoint")
MOMENT_WEIGHTS = (0.2, 0.45, 0.35)
RESUMED = re.compile(r"resumed from step (\d+)")
LOGGED_STEP = re.compile(r" step (\d+)/\d+ loss ")


@dataclasses.dataclass
class Launch:
    """One `bam-train` process of the soaked run and what its log says."""

    proc: subprocess.Popen
    log: str
    began: float

    def text(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def steps(self) -> list[int]:
        return [int(step) for step in LOGGED_STEP.findall(self.text())]

    def resumed_from(self) -> int | None:
        """The step it resumed from (0: a fresh start); None before its first step."""
        text = self.text()
        if not LOGGED_STEP.search(text):
            return None
        match = RESUMED.search(text)
        return int(match.group(1)) if match else 0


@dataclasses.dataclass
class Kill:
    moment: str
    started_from: int | None  # the step the killed launch resumed from (None: not yet known)
    reached: int | None  # the newest step the killed launch logged (None: none)
    in_flight: bool  # a checkpoint folder was still temporary when killed
    resumed: int | None = None  # the step the next launch resumed from
    restart_s: float | None = None  # from the next launch's start to its first step

    @property
    def lost(self) -> int | None:
        if self.resumed is None:
            return None
        return 0 if self.reached is None else max(self.reached - self.resumed, 0)


def train_command(args: argparse.Namespace, workdir: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bam_train",
        f"--config={args.config}",
        f"--workdir={workdir}",
        f"--config.steps={args.steps}",
        "--config.log_every=1",
        f"--config.checkpoint_every={args.checkpoint_every}",
        "--config.keep_last=2",
        "--config.async_checkpoint=true",
        "--noconfig.progress_bar",
    ]


def start(args: argparse.Namespace, workdir: str, log: str) -> Launch:
    with open(log, "w") as out:
        proc = subprocess.Popen(
            train_command(args, workdir),
            env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO},
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Launch(proc, log, time.time())


def checkpoint_in_flight(workdir: str) -> bool:
    directory = os.path.join(workdir, "checkpoints")
    return os.path.isdir(directory) and any("tmp" in n for n in os.listdir(directory))


def wait_until(
    launch: Launch, condition: Callable[[], bool], timeout_s: float = 600, every_s: float = 0.005
) -> bool:
    """True when `condition()` holds, False when the launch ended first; a TimeoutError after
    `timeout_s`."""
    deadline = time.time() + timeout_s
    while not condition():
        if launch.proc.poll() is not None:
            return False
        if time.time() > deadline:
            raise TimeoutError(f"no progress in {timeout_s} s; see {launch.log}")
        time.sleep(every_s)
    return True


def first_step_after(launch: Launch) -> int | None:
    """The step the launch resumed from, once it has logged its first step."""
    if not wait_until(launch, lambda: launch.resumed_from() is not None):
        return None
    return launch.resumed_from()


def reach_moment(
    launch: Launch, moment: str, target: int, workdir: str, rng: np.random.Generator, args
) -> bool:
    """Waits for `moment` in `launch`, at or after step `target` (or its first step after the
    one it resumed from); False when it ended first."""
    if moment == "startup":
        delay = rng.uniform(0.5, args.startup_s)
        wait_until(launch, lambda: bool(launch.steps()) or time.time() - launch.began > delay)
        return launch.proc.poll() is None
    started_from = first_step_after(launch)
    if started_from is None:
        return False
    target = max(target, started_from + 1)
    if moment == "step":
        if not wait_until(launch, lambda: max(launch.steps()) >= target):
            return False
        time.sleep(rng.uniform(0, args.step_s))
        return launch.proc.poll() is None
    return wait_until(
        launch, lambda: max(launch.steps()) >= target and checkpoint_in_flight(workdir)
    )


def kill(launch: Launch, moment: str, workdir: str) -> Kill:
    in_flight = checkpoint_in_flight(workdir)
    launch.proc.send_signal(signal.SIGKILL)
    launch.proc.wait()
    steps = launch.steps()
    if not steps:
        moment = "startup"
    elif moment == "startup":
        moment = "step"
    return Kill(moment, launch.resumed_from(), max(steps, default=None), in_flight)


def note_resume(launch: Launch, pending: list[Kill]) -> None:
    """Where `launch` resumed, for the kills before it that have no restart yet."""
    resumed = launch.resumed_from()
    if resumed is None or not pending:
        return
    for k in pending:
        k.resumed = resumed
    first_step_at = _first_step_time(launch)
    pending[-1].restart_s = None if first_step_at is None else first_step_at - launch.began


def _first_step_time(launch: Launch) -> float | None:
    match = re.search(r"^(\S+ \S+) step \d+/", launch.text(), re.MULTILINE)
    if not match:
        return None
    return time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S"))


def final_state(workdir: str, step: int) -> dict[str, np.ndarray]:
    """Every array of the state saved at `step`, by its path in the tree."""
    import jax
    import orbax.checkpoint as ocp

    # Restored on the machine that saved it, so the saved shardings apply.
    warnings.filterwarnings("ignore", message="Sharding info not provided when restoring")
    path = os.path.join(workdir, "checkpoints", str(step), "state")
    tree = ocp.PyTreeCheckpointer().restore(path)
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(key): np.asarray(value) for key, value in leaves}


def compare_states(reference: str, soaked: str, step: int) -> tuple[bool, str]:
    ref, soak = final_state(reference, step), final_state(soaked, step)
    if ref.keys() != soak.keys():
        return False, f"the trees differ: {sorted(ref.keys() ^ soak.keys())[:5]}"
    differing = [
        key
        for key in ref
        if ref[key].dtype != soak[key].dtype
        or ref[key].shape != soak[key].shape
        or ref[key].tobytes() != soak[key].tobytes()
    ]
    if differing:
        return False, f"{len(differing)} of {len(ref)} arrays differ, first {differing[0]}"
    n_bytes = sum(a.nbytes for a in ref.values())
    return True, f"all {len(ref)} arrays ({n_bytes:,} bytes: params and optimizer state) identical"


def losses(workdir: str) -> dict[int, float]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def compare_losses(reference: str, soaked: str, steps: int) -> tuple[bool, str]:
    ref, soak = losses(reference), losses(soaked)
    if sorted(soak) != list(range(1, steps + 1)):
        return False, f"the soaked run logged steps {sorted(soak)[:3]}... not 1..{steps} once each"
    differing = [step for step in ref if ref[step] != soak.get(step)]
    if differing:
        return False, f"{len(differing)} of {steps} losses differ, first at step {differing[0]}"
    return True, f"the losses of all {steps} steps identical"


def soak(args: argparse.Namespace, soaked: str, root: str) -> tuple[list[Kill], Launch]:
    rng = np.random.default_rng(args.seed)
    # The steps the kills come at or after, spread over the run; the last checkpoint
    # interval is left to the final launch, so that a checkpoint kill always has one to hit.
    targets = np.sort(rng.integers(1, args.steps - args.checkpoint_every, size=args.kills))
    kills: list[Kill] = []
    for i in range(args.kills + 1):
        launch = start(args, soaked, os.path.join(root, f"soaked-{i}.log"))
        if i == args.kills:
            break
        moment = str(rng.choice(MOMENTS, p=MOMENT_WEIGHTS))
        if not reach_moment(launch, moment, int(targets[i]), soaked, rng, args):
            print(f"the run ended before kill {i + 1}; raise --steps")
            break
        pending = [k for k in kills if k.resumed is None]
        kills.append(kill(launch, moment, soaked))
        note_resume(launch, pending)
    launch.proc.wait()
    note_resume(launch, [k for k in kills if k.resumed is None])
    return kills, launch


def run(args: argparse.Namespace) -> int:
    root = args.workdir or tempfile.mkdtemp(prefix="kill-soak-")
    os.makedirs(root, exist_ok=True)
    reference, soaked = os.path.join(root, "reference"), os.path.join(root, "soaked")
    began = time.time()
    launch = start(args, reference, os.path.join(root, "reference.log"))
    if launch.proc.wait() != 0:
        print(launch.text()[-3000:])
        return 1
    reference_s = time.time() - began
    kills, last = soak(args, soaked, root)
    print(_table(kills))
    if last.proc.returncode != 0:
        print(f"the last launch exited with {last.proc.returncode}:\n{last.text()[-3000:]}")
        return 1
    same_state, state_detail = compare_states(reference, soaked, args.steps)
    same_losses, loss_detail = compare_losses(reference, soaked, args.steps)
    print(_summary(kills, reference_s, time.time() - began - reference_s, root))
    print(f"final state at step {args.steps} against the uninterrupted run: {state_detail}")
    print(f"metrics.jsonl against the uninterrupted run: {loss_detail}")
    all_resumed = all(k.resumed is not None for k in kills)
    return 0 if same_state and same_losses and all_resumed else 1


def _summary(kills: list[Kill], reference_s: float, soak_s: float, root: str) -> str:
    lost = [k.lost for k in kills if k.lost is not None]
    resumes = sum(k.resumed is not None for k in kills)
    by_moment = ", ".join(f"{m} {sum(k.moment == m for k in kills)}" for m in MOMENTS)
    in_flight = sum(k.in_flight for k in kills)
    return (
        f"\n{len(kills)} kills ({by_moment}; {in_flight} with a checkpoint in flight), "
        f"{resumes} resumes, {sum(lost)} steps trained again in all (mean "
        f"{np.mean(lost or [0]):.1f} per kill, max {max(lost, default=0)}); uninterrupted "
        f"run {reference_s:.0f} s, soaked run {soak_s:.0f} s; workdirs in {root}"
    )


def _table(kills: list[Kill]) -> str:
    rows = [
        "| kill | moment | checkpoint in flight | launch resumed from | last step logged "
        "| next launch resumed from | steps lost | restart to first step (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def cell(value: float | int | None, spec: str = "") -> str:
        return "-" if value is None else format(value, spec)

    for i, k in enumerate(kills, 1):
        rows.append(
            f"| {i} | {k.moment} | {'yes' if k.in_flight else 'no'} | {cell(k.started_from)} "
            f"| {cell(k.reached)} | {cell(k.resumed)} | {cell(k.lost)} "
            f"| {cell(k.restart_s, '.0f')} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="quickstart")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--checkpoint_every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step_s", type=float, default=0.2, help="longest wait after a step")
    parser.add_argument("--startup_s", type=float, default=20.0, help="latest startup kill")
    parser.add_argument("--workdir", default=None, help="default: a new temporary folder")
    args = parser.parse_args()
    for name in ("kills", "steps", "checkpoint_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.steps <= 2 * args.checkpoint_every:
        parser.error(f"--steps must exceed twice --checkpoint_every, got {args.steps}")
    sys.exit(run(args))


if __name__ == "__main__":
    main()
