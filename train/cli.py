"""`bam-train` (also `python -m train`): train a BAM model.

  bam-train --config=tiny --workdir=/tmp/bam-tiny
  bam-train --config=l12_512 --workdir=runs/l12 --config.data.path=DIR --config.steps=5000
  bam-train --config=my_config.py --workdir=DIR          (a file with get_config())
  bam-train --config=DIR/config.json --workdir=DIR2      (a resolved config)
  bam-train --config=tiny --dry-run                      (compile, print size and memory)

Any field can be overridden with `--config.FIELD=VALUE`, nested with dots:
`--config.model.encoding=rope`, `--config.optim.lr=3e-4`, `--config.mesh.fsdp=4`,
`--config.data.source=text --config.data.path=corpus/`. A workdir that holds checkpoints is
resumed from its latest one.

Several processes (hosts): pass --coordinator=HOST:PORT --num_processes=N --process_id=I
to every process (or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import types
import typing
from typing import Any

from absl import flags
from ml_collections import ConfigDict, config_dict, config_flags

from train.config import TrainConfig

CONFIG_HELP = (
    "A preset name (tiny, micro, anchor, l6_512 ... l24_1024), a Python file with "
    "get_config(), or a config.json written by a run. Override any field with "
    "--config.FIELD=VALUE, e.g. --config.steps=1000 --config.model.encoding=rope "
    "--config.optim.lr=3e-4 --config.data.path=DIR."
)


def _presets_file() -> str:
    import configs.presets

    return configs.presets.__file__


def load_config(spec: str) -> TrainConfig:
    """A preset by name, or a resolved config from a JSON file."""
    from configs.presets import PRESETS, preset

    if spec in PRESETS:
        return preset(spec)
    if spec.endswith(".json"):
        if not os.path.isfile(spec):
            raise ValueError(f"config: file {spec!r} does not exist")
        with open(spec, encoding="utf-8") as f:
            return TrainConfig.from_dict(json.load(f))
    raise ValueError(
        f"config: expected a preset name {sorted(PRESETS)}, a .py file or a .json file, "
        f"got {spec!r}"
    )


def _field_value(value: Any, annotation: Any) -> Any:
    """A ConfigDict value that accepts overrides of the field's declared type."""
    if dataclasses.is_dataclass(value):
        return config_dict_from(value)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    if is_union and len(args) > 1:
        return config_dict.FieldReference(value, field_type=object)
    if value is None:
        return config_dict.placeholder(args[0] if args else object)
    return value


def config_dict_from(cfg: Any) -> ConfigDict:
    """A ConfigDict mirroring a (nested) config dataclass, typed for command-line overrides."""
    hints = typing.get_type_hints(type(cfg))
    return ConfigDict(
        {f.name: _field_value(getattr(cfg, f.name), hints[f.name]) for f in dataclasses.fields(cfg)}
    )


def to_train_config(cd: ConfigDict | TrainConfig) -> TrainConfig:
    if isinstance(cd, TrainConfig):
        return cd
    return TrainConfig.from_dict(cd.to_dict())


def _rewrite_config_flag(argv: list[str]) -> list[str]:
    """`--config=NAME` or `--config=FILE.json` become the presets file with an argument;
    `--dry-run` is accepted for `--dry_run`."""
    out = []
    for arg in argv:
        if arg == "--dry-run":
            arg = "--dry_run"
        if arg.startswith("--config="):
            value = arg.split("=", 1)[1]
            if not value.split(":", 1)[0].endswith(".py"):
                _check_config_spec(value)
                arg = f"--config={_presets_file()}:{value}"
        out.append(arg)
    return out


def _check_config_spec(spec: str) -> None:
    from configs.presets import PRESETS

    if spec.endswith(".json"):
        load_config(spec)
    elif spec not in PRESETS:
        raise ValueError(
            f"config: unknown preset {spec!r}; expected one of {sorted(PRESETS)}, "
            "a .py file with get_config() or a .json file"
        )


def define_flags(flag_values: flags.FlagValues, argv: list[str] | None = None) -> None:
    """Define the flags; `argv` names the `--config.FIELD` overrides to accept."""
    config_flags.DEFINE_config_file(
        "config", None, CONFIG_HELP, flag_values=flag_values, lock_config=True, sys_argv=argv
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
    flags.DEFINE_string(
        "coordinator",
        os.environ.get("JAX_COORDINATOR_ADDRESS"),
        "host:port of process 0 for multi-process runs.",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "num_processes",
        int(os.environ.get("JAX_NUM_PROCESSES", "1")),
        "Number of processes.",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "process_id",
        int(os.environ.get("JAX_PROCESS_ID", "0")),
        "This process's index.",
        flag_values=flag_values,
    )
    flags.DEFINE_enum(
        "cpu_collectives",
        "gloo",
        ["gloo", "none"],
        "CPU collectives for multi-process CPU runs.",
        flag_values=flag_values,
    )


def parse_args(argv: list[str]) -> tuple[TrainConfig, flags.FlagValues]:
    """Parse a full argv (program name first) into a validated config and the flags."""
    argv = _rewrite_config_flag(argv)
    flag_values = flags.FlagValues()
    define_flags(flag_values, argv)
    try:
        flag_values(argv)
    except (KeyError, AttributeError) as err:
        raise ValueError(f"config: unknown field {err}") from None
    except flags.IllegalFlagValueError as err:
        lines = str(err).strip().splitlines()
        raise ValueError(lines[-1] if "Traceback" in str(err) else lines[0]) from None
    if flag_values.config is None:
        raise ValueError(f"--config is required: {CONFIG_HELP}")
    return to_train_config(flag_values.config), flag_values


def initialize_distributed(flag_values: flags.FlagValues) -> None:
    if flag_values.num_processes <= 1:
        return
    import jax

    if flag_values.cpu_collectives != "none":
        jax.config.update("jax_cpu_collectives_implementation", flag_values.cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=flag_values.coordinator,
        num_processes=flag_values.num_processes,
        process_id=flag_values.process_id,
    )


def run(argv: list[str]) -> int:
    try:
        cfg, flag_values = parse_args(argv)
    except (ValueError, flags.Error) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not flag_values.workdir and not flag_values.dry_run:
        print("error: --workdir is required", file=sys.stderr)
        return 2
    initialize_distributed(flag_values)
    from train.loop import NonFiniteLossError, build, dry_run, format_dry_run, train

    try:
        if flag_values.dry_run:
            print(format_dry_run(dry_run(build(cfg))))
            return 0
        result = train(cfg, flag_values.workdir)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except NonFiniteLossError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(
        f"{'stopped (SIGTERM)' if result.preempted else 'done'} at step {result.step}, "
        f"loss {result.last_loss}"
    )
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv if argv is None else argv
    if any(a in ("--help", "-h", "--helpshort", "--helpfull") for a in argv[1:]):
        flag_values = flags.FlagValues()
        define_flags(flag_values)
        print(__doc__)
        print(flag_values.get_help())
        sys.exit(0)
    sys.exit(run(argv))
