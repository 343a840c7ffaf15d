"""The `args.json` of a reference run directory, read into a ModelConfig.

The file is {"args": {"position_encoding": ...}, "model_args": {...}} as the authors' code
writes it. Their runs name the GGD prior's flags either theta_* (newer) or
shape/scale/loc (older), write integers as floats at times, and leave unset flags null;
every field is read as their code reads it, and anything else is a ValueError naming the
file and the field.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from bam_jax.config import Encoding, ModelConfig
from bam_jax.validation import is_int

ARGS_FILE = "args.json"

# Reference `position_encoding` name -> our encoding.
REFERENCE_ENCODINGS: dict[str, str] = {
    "nope": "nope",
    "nope_ssmax": "nope_ssmax",
    "sinusoidal": "sinusoidal",
    "sinusoidal_ssmax": "sinusoidal_ssmax",
    "rotary": "rope",
    "rotary_ssmax": "rope_ssmax",
    "rotary_local": "rope_local",
    "alibi": "alibi",
    "alibi_ssmax": "alibi_ssmax",
    "bam": "bam",
    "bam_ssmax": "bam_ssmax",
}
TO_REFERENCE_ENCODING = {ours: ref for ref, ours in REFERENCE_ENCODINGS.items()}

# ModelConfig fields that do not change the parameters and may be set at load time.
LOAD_OVERRIDES = (
    "dtype",
    "attention_impl",
    "block_q",
    "block_k",
    "remat",
    "scan_layers",
    "ssmax_prior_inside",
    "prior_form",
)


def read_reference_config(
    args_path: str | os.PathLike, *, dtype: str | None = None, **overrides: Any
) -> ModelConfig:
    """The ModelConfig described by a reference `args.json`."""
    args_path = Path(args_path)
    run_args = _read_json(args_path)
    reference_name = _position_encoding(run_args, args_path)
    model_args = run_args["model_args"]
    encoding = REFERENCE_ENCODINGS[reference_name]
    fields = _architecture_fields(model_args, args_path)
    fields["encoding"] = encoding
    positional = Encoding.parse(encoding)
    if positional.rotary:
        fields["rope_theta"] = _number(model_args, "rope_theta", args_path, default=500000.0)
    if positional.absolute:
        fields["sinusoidal_theta"] = _number(
            model_args, "sinusoidal_theta", args_path, default=10000.0
        )
    if positional.learned_prior:
        fields.update(_prior_fields(model_args, args_path))
    if positional.ssmax:
        fields["train_ssmax_scale"] = _flag(model_args, "seq_scale", args_path, default=True)
    if positional.learned_prior and positional.ssmax:
        fields["ssmax_prior_inside"] = _ssmax_prior(model_args, args_path)
    if dtype is not None:
        fields["dtype"] = jnp.dtype(dtype).name
    unknown = sorted(set(overrides) - set(LOAD_OVERRIDES))
    if unknown:
        raise ValueError(f"cannot override {unknown} at load time; allowed: {LOAD_OVERRIDES}")
    fields.update(overrides)
    try:
        return ModelConfig(**fields)
    except ValueError as error:
        raise ValueError(f"{args_path}: {error}") from error


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"{path}: missing (a reference run directory holds {ARGS_FILE})")
    try:
        run_args = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(run_args, dict):
        raise ValueError(f"{path}: expected a JSON object with 'args' and 'model_args'")
    for section in ("args", "model_args"):
        if not isinstance(run_args.get(section), dict):
            raise ValueError(f"{path}: missing the {section!r} object")
    return run_args


def _position_encoding(run_args: dict, path: Path) -> str:
    name = run_args["args"].get("position_encoding")
    if name not in REFERENCE_ENCODINGS:
        raise ValueError(
            f"{path}: args.position_encoding {name!r} is not supported; "
            f"expected one of {sorted(REFERENCE_ENCODINGS)}"
        )
    return name


def _architecture_fields(model_args: dict, path: Path) -> dict[str, Any]:
    fields = {name: _int(model_args, name, path) for name in _REQUIRED_INTS}
    fields["n_kv_heads"] = _int(model_args, "n_kv_heads", path, default=None)
    fields["multiple_of"] = _int(model_args, "multiple_of", path, default=1)
    # The reference's hidden size is int(multiplier * dim), or dim when the multiplier is None.
    fields["ffn_dim_multiplier"] = _number(model_args, "ffn_dim_multiplier", path, default=1.0)
    fields["norm_eps"] = _number(model_args, "norm_eps", path, default=1e-5)
    return fields


_REQUIRED_INTS = ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len")


def _prior_fields(model_args: dict, path: Path) -> dict[str, Any]:
    """Prior flags of either naming: theta_* (newer) or shape/scale/loc (older runs)."""
    legacy = any(k in model_args for k in ("shape_init", "scale_init", "loc_init", "train_shape"))
    names = (
        ("scale_init", "shape_init", "loc_init", "train_scale", "train_shape", "train_loc")
        if legacy
        else (
            "theta_alpha_init",
            "thata_beta_init" if "thata_beta_init" in model_args else "theta_beta_init",
            "theta_mu_init",
            "train_theta_alpha",
            "train_theta_beta",
            "train_theta_mu",
        )
    )
    alpha_name, beta_name, mu_name, *train_names = names
    train_alpha, train_beta, train_mu = (
        _flag(model_args, name, path, default=default)
        for name, default in zip(train_names, (True, True, False), strict=True)
    )
    global_prior = model_args.get("global_positional_encoding", True)
    if global_prior is not None and not isinstance(global_prior, bool):
        raise ValueError(f"{path}: model_args.global_positional_encoding must be a bool or null")
    return {
        # The reference sets exp(scale) = scale_init, but theta_alpha = theta_alpha_init.
        "prior_alpha_init": _init_value(
            model_args, alpha_name, path, ("slope", "sampled"), default=1.0, log_scale=not legacy
        ),
        # A frozen shape starts at 1 in the reference whatever its init flag says.
        "prior_beta_init": (
            _init_value(
                model_args, beta_name, path, ("linear", "sampled"), default=0.0, log_scale=False
            )
            if train_beta
            else 1.0
        ),
        "prior_mu_init": _number(model_args, mu_name, path, default=0.0),
        "train_prior_alpha": train_alpha,
        "train_prior_beta": train_beta,
        "train_prior_mu": train_mu,
        # The reference treats null (an unset command-line flag) as false: per-layer priors.
        "global_prior": bool(global_prior),
    }


_MISSING = object()


def _int(model_args: dict, name: str, path: Path, default: Any = _MISSING) -> Any:
    value = model_args.get(name)
    if value is None:
        if default is _MISSING:
            raise ValueError(f"{path}: model_args.{name} is missing (expected an int)")
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not is_int(value):
        raise ValueError(f"{path}: model_args.{name} must be an int, got {value!r}")
    return value


def _number(model_args: dict, name: str, path: Path, *, default: float) -> float:
    value = model_args.get(name)
    if value is None:
        return default
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{path}: model_args.{name} must be a number, got {value!r}") from None


def _flag(model_args: dict, name: str, path: Path, *, default: bool) -> bool:
    value = model_args.get(name, default)
    if value is None:
        return default
    if value in (0, 1):  # also matches False / True
        return bool(value)
    raise ValueError(f"{path}: model_args.{name} must be a bool, got {value!r}")


def _ssmax_prior(model_args: dict, path: Path) -> bool:
    """bam_ssmax's `ssmax_prior`: missing is the authors' default, true; null is false, as
    their model reads it (`if self.ssmax_prior`)."""
    if "ssmax_prior" not in model_args:
        return True
    value = model_args["ssmax_prior"]
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{path}: model_args.ssmax_prior must be true or false, got {value!r}")
    return bool(value)


def _init_value(
    model_args: dict,
    name: str,
    path: Path,
    modes: tuple[str, ...],
    *,
    default: float,
    log_scale: bool,
) -> str | float:
    """An init flag: one of `modes` or a number (exp'd when the flag is a log-scale)."""
    value = model_args.get(name)
    if value is None:
        return default
    if value in modes:
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"{path}: model_args.{name} must be one of {modes} or a number, got {value!r}"
        ) from None
    return math.exp(number) if log_scale else number
