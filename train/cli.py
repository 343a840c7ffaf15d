"""`bam-train` (also `python -m bam_train`): train a BAM model.

  bam-train --config=tiny --workdir=/tmp/bam-tiny
  bam-train --config=l12_512 --workdir=runs/l12 --config.data.path=DIR --config.steps=5000
  bam-train --config=my_config.py --workdir=DIR          (a file with get_config())
  bam-train --config=my_config.py:ARG --workdir=DIR      (calls get_config(ARG))
  bam-train --config=DIR/config.json --workdir=DIR2      (a resolved config)
  bam-train --config=tiny --dry-run                      (compile, print size and memory)
  bam-train --config=tiny --print_config                 (print the resolved config as JSON)

`--config` names a training preset (configs/presets.py), a Python file whose `get_config()`
returns an ml_collections ConfigDict (as in the Flax examples; fields it leaves out keep
their defaults) or a TrainConfig, or a config.json written by a run. Any field can be
overridden with `--config.FIELD=VALUE`, nested with dots: `--config.model.encoding=rope`,
`--config.optim.lr=3e-4`, `--config.mesh.fsdp=4`, `--config.data.source=text
--config.data.path=corpus/`. A workdir that holds checkpoints is resumed from its latest one.

The overrides are ml_collections' config flags on a ConfigDict mirror of the TrainConfig
(`bam_configs.training.to_config_dict`), turned back into a TrainConfig by `TrainConfig.from_dict`;
`config_flags.DEFINE_config_dataclass` cannot be used directly, since it sets fields in
place, which the frozen config dataclasses refuse.

Several processes (hosts): on a TPU pod slice, or under Slurm or Open MPI with more than one
task, `--distributed=auto` (the default) calls `jax.distributed.initialize()` without
arguments and jax reads the cluster from its environment; `--distributed=cluster` does so
everywhere (e.g. a TPU VM pod, found through its metadata server). Elsewhere pass
--coordinator=HOST:PORT --num_processes=N --process_id=I to every process (or set
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); `--distributed=off` never
initializes.

Exit status: 0 done (or stopped by SIGTERM, saved), 1 a non-finite loss or a full disk, 2 a
bad flag, config or workdir, 130 Ctrl-C, 75 another process of a multi-process run stopped
(restart every process with the same command: it resumes from the last complete
checkpoint). A multi-process run trains in a child process that `bam-train` watches
(bam_train.peers): a lost peer ends every other process within about --peer_timeout seconds
with one line naming it and the checkpoint the restart resumes from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys

from absl import flags
from ml_collections import ConfigDict, config_flags

from bam_configs.loading import load_config
from bam_configs.presets import TRAINING_PRESETS
from bam_configs.training import TrainConfig, describe_type, field_type, to_config_dict
from bam_jax import compilation_cache
from bam_jax.io.checkpoints import quiet_orphaned_checkpoint_reads
from bam_jax.logs import log_to_stdout
from bam_train.checkpoint import DiskFullError, quiet_full_disk_reports
from bam_train.dry_run import dry_run, format_dry_run
from bam_train.loop import train
from bam_train.peers import (
    CHILD_ENV,
    DEFAULT_PEER_TIMEOUT_S,
    RunPlace,
    await_runtime_verdict,
    is_peer_failure,
    quiet_peer_failure_reports,
    supervise,
)
from bam_train.setup import build
from bam_train.signals import INTERRUPTED_STATUS
from bam_train.step import NonFiniteLossError

DISTRIBUTED_MODES = ("auto", "cluster", "off")

# Process counts that jax's cluster detection reads, by scheduler.
CLUSTER_PROCESS_COUNTS = {
    "Slurm": "SLURM_NTASKS",
    "Open MPI": "OMPI_COMM_WORLD_SIZE",
}

CONFIG_HELP = (
    f"A preset name ({', '.join(TRAINING_PRESETS)}: configs/presets.py), a Python file with "
    "get_config() (FILE.py:ARG calls get_config(ARG)), or a config.json written by a run. "
    "Override any field with --config.FIELD=VALUE, e.g. --config.steps=1000 "
    "--config.model.encoding=rope --config.optim.lr=3e-4 --config.data.path=DIR."
)
# An override such as --config.model.dim=64, --config.steps 5 or --noconfig.progress_bar.
OVERRIDE = re.compile(r"^--?(?:no)?config\.([^=]*)")
# How absl reports a value it cannot parse: "flag --NAME=VALUE: REASON".
BAD_OVERRIDE_VALUE = re.compile(r"^flag --config\.([\w.]+)=(.*?): ", re.DOTALL)


def _config_spec(argv: list[str]) -> tuple[str, list[str]]:
    """The value of `--config` (absl's forms: `--config=SPEC`, `--config SPEC`) and the other
    arguments."""
    spec_flag = flags.FlagValues()
    flags.DEFINE_multi_string("config", None, CONFIG_HELP, flag_values=spec_flag)
    try:
        rest = spec_flag(argv, known_only=True)
    except flags.Error:
        raise ValueError(f"--config needs a value: {CONFIG_HELP}") from None
    specs = spec_flag.config or []
    if any(spec.startswith("-") or not spec for spec in specs):
        raise ValueError(f"--config needs a value: {CONFIG_HELP}")
    if not specs:
        raise ValueError(f"--config is required: {CONFIG_HELP}")
    if len(specs) > 1:
        raise ValueError(
            f"--config is given {len(specs)} times ({', '.join(specs)}); give it once and "
            "change fields with --config.FIELD=VALUE"
        )
    return specs[0], rest


def _check_override_paths(argv: list[str]) -> None:
    for arg in argv:
        match = OVERRIDE.match(arg)
        if match:
            field_type(match.group(1))


def _bad_override_value(err: flags.IllegalFlagValueError) -> ValueError:
    """absl's message for an override value of the wrong type, as one line naming the
    field and the values it takes."""
    match = BAD_OVERRIDE_VALUE.match(str(err))
    if not match:
        return ValueError(str(err).strip().splitlines()[0])
    path, value = match.groups()
    kind = field_type(path)
    expected = (
        f"a dict of its fields (or set one with --config.{path}.FIELD=VALUE)"
        if dataclasses.is_dataclass(kind)
        else describe_type(kind)
    )
    return ValueError(f"config: {path} must be {expected}, got {value!r}")


def define_flags(
    flag_values: flags.FlagValues,
    config: ConfigDict | None = None,
    argv: list[str] | None = None,
) -> None:
    """Define the flags; `argv` names the `--config.FIELD` overrides of `config` to accept
    (without a config, `--config` is only described, for --help)."""
    if config is None:
        flags.DEFINE_string("config", None, CONFIG_HELP, flag_values=flag_values)
    else:
        config_flags.DEFINE_config_dict(
            "config", config, CONFIG_HELP, flag_values=flag_values, sys_argv=argv
        )
    flags.DEFINE_string(
        "workdir", None, "Run directory: checkpoints, metrics, config.", flag_values=flag_values
    )
    flags.DEFINE_bool(
        "dry_run",
        False,
        "Build, shard and compile the step; print size and memory; exit.",
        flag_values=flag_values,
    )
    flags.DEFINE_bool(
        "print_config",
        False,
        "Print the resolved config (the config.json of a run) and exit.",
        flag_values=flag_values,
    )
    flags.DEFINE_string(
        "coordinator",
        os.environ.get("JAX_COORDINATOR_ADDRESS"),
        "host:port of process 0 for multi-process runs.",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "num_processes",
        _environment_int("JAX_NUM_PROCESSES", 1),
        "Number of processes.",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "process_id",
        _environment_int("JAX_PROCESS_ID", 0),
        "This process's index.",
        flag_values=flag_values,
    )
    flags.DEFINE_enum(
        "distributed",
        "auto",
        list(DISTRIBUTED_MODES),
        "auto: the explicit flags when --num_processes > 1, else jax's cluster detection "
        "under Slurm / Open MPI / a TPU pod with several processes, else one process; "
        "cluster: always jax.distributed.initialize() without arguments; off: one process.",
        flag_values=flag_values,
    )
    flags.DEFINE_string(
        "compilation_cache", None, compilation_cache.FLAG_HELP, flag_values=flag_values
    )
    flags.DEFINE_integer(
        "peer_timeout",
        DEFAULT_PEER_TIMEOUT_S,
        "Multi-process runs: seconds after which a process whose heartbeats stopped counts as "
        "lost; every other process then exits with status 75 (restart me).",
        flag_values=flag_values,
    )
    flags.DEFINE_bool(
        "debug",
        False,
        "Let through the tracebacks and the distributed runtime's logs that a lost peer causes.",
        flag_values=flag_values,
    )
    flags.DEFINE_enum(
        "cpu_collectives",
        "gloo",
        ["gloo", "none"],
        "CPU collectives for multi-process CPU runs.",
        flag_values=flag_values,
    )


def _environment_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an int, got {value!r}") from None


def parse_args(argv: list[str]) -> tuple[TrainConfig, flags.FlagValues]:
    """Parse a full argv (program name first) into a validated config and the flags."""
    argv = flags.FlagValues().read_flags_from_files(argv, force_gnu=False)
    spec, argv = _config_spec(["--dry_run" if arg == "--dry-run" else arg for arg in argv])
    _check_override_paths(argv)
    flag_values = flags.FlagValues()
    define_flags(flag_values, to_config_dict(load_config(spec)), argv)
    extra = _parse_flags(flag_values, argv)[1:]
    if extra:
        raise ValueError(
            f"unexpected argument {extra[0]!r}; flags take the form --NAME=VALUE "
            "(bam-train --help lists them)"
        )
    _check_process_flags(flag_values)
    return TrainConfig.from_dict(flag_values.config.to_dict()), flag_values


def _parse_flags(flag_values: flags.FlagValues, argv: list[str]) -> list[str]:
    """absl's parse, its errors as one line naming the flag; the positional arguments."""
    try:
        return flag_values(argv)
    except flags.IllegalFlagValueError as err:
        raise _bad_override_value(err) from None
    except flags.UnrecognizedFlagError as err:
        raise ValueError(_unknown_flag_message(err.flagname)) from None
    except (KeyError, AttributeError) as err:
        message = str(err.args[0] if err.args else err).splitlines()[0].strip("'\"")
        raise ValueError(f"config: cannot override {message}") from None


def _unknown_flag_message(name: str) -> str:
    try:
        field_type(name)
    except ValueError:
        return f"unknown flag --{name} (bam-train --help lists them)"
    return f"unknown flag --{name}; to set the config field, use --config.{name}=VALUE"


def _check_process_flags(flag_values: flags.FlagValues) -> None:
    n, i = flag_values.num_processes, flag_values.process_id
    if n < 1:
        raise ValueError(f"--num_processes must be >= 1, got {n}")
    if not 0 <= i < n:
        raise ValueError(f"--process_id must be in [0, {n - 1}] for {n} processes, got {i}")
    if flag_values.peer_timeout < 1:
        raise ValueError(f"--peer_timeout must be >= 1 second, got {flag_values.peer_timeout}")
    if n > 1 and not flag_values.coordinator:
        raise ValueError(
            "--coordinator=HOST:PORT (process 0's address) is required with --num_processes > 1"
        )


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


def _run_place(flag_values: flags.FlagValues, mode: str) -> RunPlace:
    if mode != "explicit":
        return RunPlace(flag_values.workdir)
    return RunPlace(flag_values.workdir, flag_values.process_id, flag_values.num_processes)


def run(argv: list[str]) -> int:
    """`bam-train` with a full argv; the exit status (2: a bad flag or config)."""
    try:
        if any(a in ("--help", "-h", "--helpshort", "--helpfull") for a in argv[1:]):
            print(_help())
            return 0
        cfg, flag_values = parse_args(argv)
    except (ValueError, flags.Error) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if flag_values.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    if not flag_values.workdir and not flag_values.dry_run:
        print("error: --workdir is required", file=sys.stderr)
        return 2
    try:
        compilation_cache.use_compilation_cache(flag_values.compilation_cache)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    mode = distributed_mode(flag_values, dict(os.environ))
    if mode != "off" and CHILD_ENV not in os.environ:
        return supervise(argv, _run_place(flag_values, mode), flag_values.debug)
    initialize_distributed(flag_values)
    quiet_orphaned_checkpoint_reads()
    quiet_full_disk_reports()
    if mode != "off" and not flag_values.debug:
        quiet_peer_failure_reports()
    log_to_stdout()

    try:
        with _peer_failures_wait_for_the_runtime(mode, flag_values):
            if flag_values.dry_run:
                print(format_dry_run(dry_run(build(cfg))))
                return 0
            result = train(cfg, flag_values.workdir)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (NonFiniteLossError, DiskFullError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        resume = (
            ""
            if flag_values.dry_run
            else f"; the same command resumes from the latest checkpoint in {flag_values.workdir}"
        )
        print(f"interrupted (Ctrl-C): stopped without saving{resume}", file=sys.stderr)
        return INTERRUPTED_STATUS
    if result.interrupted:
        print(
            f"interrupted (Ctrl-C): saved step {result.step} to {flag_values.workdir}; the "
            "same command resumes",
            file=sys.stderr,
        )
        return INTERRUPTED_STATUS
    print(
        f"{'stopped (SIGTERM)' if result.preempted else 'done'} at step {result.step}, "
        f"loss {result.last_loss}"
    )
    return 0


@contextlib.contextmanager
def _peer_failures_wait_for_the_runtime(mode: str, flag_values: flags.FlagValues):
    """A multi-process run's error that a lost peer caused waits for the runtime to name
    the peer (bam_train.peers) instead of being printed."""
    try:
        yield
    except Exception as err:
        if mode == "off" or not is_peer_failure(err):
            raise
        await_runtime_verdict(err, flag_values.peer_timeout, flag_values.debug)


def _help() -> str:
    flag_values = flags.FlagValues()
    define_flags(flag_values)
    return f"{__doc__}\n{flag_values.get_help()}"


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(sys.argv if argv is None else argv))
