"""Reading a training config from what `--config` names: a training preset, a Python file
whose `get_config()` returns an ml_collections ConfigDict of TrainConfig fields (as in the
Flax examples) or a TrainConfig, or a config.json written by a run. Every error is a
ValueError that names the file and, for code in a config file, its line."""

from __future__ import annotations

import json
import os
import sys
import traceback
import types

from ml_collections import ConfigDict

from bam_configs.presets import TRAINING_PRESETS, preset
from bam_configs.training import TrainConfig

PY_CONFIG_RESULT = "an ml_collections ConfigDict of TrainConfig fields or a TrainConfig"


def load_config(spec: str) -> TrainConfig:
    """The config `--config=SPEC` names: a training preset, a .py file with get_config()
    (`FILE.py:ARG` calls get_config(ARG)) or a config.json."""
    path, _, arg = spec.partition(":")
    if path.endswith(".py"):
        return _python_config(path, arg or None)
    if spec in TRAINING_PRESETS:
        return preset(spec)
    if spec.endswith(".json"):
        return TrainConfig.from_dict(_read_json_config(spec))
    if os.path.isdir(spec):
        raise ValueError(
            f"config: {spec!r} is a directory; pass a preset name, a .py file or a "
            f"config.json (a run's is {os.path.join(spec, 'config.json')})"
        )
    raise ValueError(
        f"config: unknown preset {spec!r}; expected one of {sorted(TRAINING_PRESETS)}, "
        "a .py file with get_config() or a .json file"
    )


def _read_json_config(path: str) -> dict:
    if os.path.isdir(path):
        raise ValueError(f"config: {path!r} is a directory, not a config.json file")
    if not os.path.isfile(path):
        raise ValueError(f"config: file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"config: {path} line {err.lineno} column {err.colno}: not valid JSON: {err.msg}"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"config: cannot read {path}: {err}") from None
    if not isinstance(d, dict):
        raise ValueError(
            f"config: {path} must hold a JSON object of config fields, got a JSON "
            f"{type(d).__name__}"
        )
    return d


def _python_config(path: str, arg: str | None) -> TrainConfig:
    module = _run_config_file(path)
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
        raise ValueError(
            f"config: {path} defines no get_config(); define one returning {PY_CONFIG_RESULT}"
        )
    try:
        config = get_config() if arg is None else get_config(arg)
    except Exception as err:
        raise _config_file_error(path, err) from None
    if isinstance(config, TrainConfig):
        return config
    if isinstance(config, ConfigDict):
        return TrainConfig.from_dict(config.to_dict())
    raise ValueError(
        f"config: {path}: get_config() returned {type(config).__name__}; expected "
        f"{PY_CONFIG_RESULT}"
    )


def _run_config_file(path: str) -> types.ModuleType:
    """The module of a config file, run; its errors name the file and line."""
    if not os.path.isfile(path):
        raise ValueError(f"config: file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            code = compile(f.read(), path, "exec")
    except SyntaxError as err:
        raise ValueError(
            f"config: {path} line {err.lineno}: {type(err).__name__}: {err.msg}"
        ) from None
    except (OSError, ValueError) as err:
        raise ValueError(f"config: cannot read {path}: {err}") from None
    module = types.ModuleType("bam_train_config")
    module.__file__ = path
    # Dataclasses defined in the file look their module up in sys.modules.
    sys.modules[module.__name__] = module
    try:
        exec(code, module.__dict__)
    except Exception as err:
        raise _config_file_error(path, err) from None
    return module


def _config_file_error(path: str, err: Exception) -> ValueError:
    """`err`, raised by the code of config file `path`, as one line naming the file's line."""
    lines = [f.lineno for f in traceback.extract_tb(err.__traceback__) if f.filename == path]
    where = f"{path} line {lines[-1]}" if lines else path
    return ValueError(f"config: {where}: {type(err).__name__}: {err}")
