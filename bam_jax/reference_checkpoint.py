"""Import and export of the reference PyTorch checkpoints (docs/spec.md section 8).

A reference run directory holds `args.json` ({"args": {"position_encoding": ...},
"model_args": {...}}) and the weights: `model.pt` (a torch state dict; needs the optional
`torch` extra) or `model.npz` (the same keys and arrays, readable without torch). Keys may
carry `module.` / `_orig_mod.` prefixes; the GGD prior is named either
`prior.{shape,scale,loc}` (older runs) or `prior.{theta_beta,theta_alpha,theta_mu}`, one
global prior or one per layer. Torch Linear weights are [out, in]; our kernels [in, out].

Everything is validated before a model is built: a missing file, an unknown encoding, a
missing, unexpected or duplicated key and a wrong shape raise a ValueError that names the
file, the key and what was expected.

An imported model computes what the run was trained with. The GGD prior takes its
training form, -exp(theta_alpha) * (|d - mu| + eps) ** theta_beta; the authors' evaluation
code computes -(|d - mu| * exp(theta_alpha) + eps) ** theta_beta for `bam` (no SSMax)
runs, which `prior_form="inference"` reproduces (docs/spec.md section 2). For bam_ssmax,
`model_args.ssmax_prior` (missing: true, the authors' default) decides whether the prior is
added before the SSMax scaling (true, our `ssmax_prior_inside=True`) or after it.
"""

from __future__ import annotations

import json
import math
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bam_jax.config import Encoding, ModelConfig
from bam_jax.io.files import write_atomically
from bam_jax.model import Transformer

ARGS_FILE = "args.json"
TORCH_FILE = "model.pt"
NUMPY_FILE = "model.npz"
KEY_PREFIXES = ("module.", "_orig_mod.")

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

PRIOR_LEAVES = ("theta_alpha", "theta_beta", "theta_mu")
LEGACY_PRIOR_LEAVES = {"scale": "theta_alpha", "shape": "theta_beta", "loc": "theta_mu"}
TO_LEGACY_PRIOR_LEAVES = {theta: legacy for legacy, theta in LEGACY_PRIOR_LEAVES.items()}

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

PriorNaming = Literal["theta", "legacy"]


# --------------------------------------------------------------------------- loading


def load_reference_checkpoint(
    run_dir: str | os.PathLike,
    *,
    dtype: str | None = None,
    weights: str | None = None,
    **overrides: Any,
) -> tuple[ModelConfig, Transformer]:
    """Reads a reference run directory and returns our config and model.

    dtype: compute dtype of the model ("float32" or "bfloat16"; parameters stay float32).
    weights: "model.pt" or "model.npz"; by default the one present (an error if both are).
    overrides: ModelConfig fields that leave the parameters unchanged (LOAD_OVERRIDES),
        e.g. attention_impl="blockwise" for long contexts, ssmax_prior_inside (instead of
        the run's `ssmax_prior`) or prior_form="inference" (the prior of the authors'
        evaluation of `bam` runs).
    """
    run_dir = Path(run_dir)
    weights_path = _weights_path(run_dir, weights)
    config = read_reference_config(run_dir / ARGS_FILE, dtype=dtype, **overrides)
    state = canonical_state(_read_weights(weights_path), weights_path)
    validate_reference_state(state, config, weights_path)
    return config, _build_model(config, state)


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


def reference_state_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every key of the reference state dict (no prefixes, theta_* prior names) -> shape."""
    dim, heads, hidden = config.dim, config.n_heads, config.ffn_hidden_dim
    q_dim, kv_dim = heads * config.head_dim, config.kv_heads * config.head_dim
    per_head = (1, heads, 1, 1)
    shapes = {"tok_embeddings.weight": (config.vocab_size, dim)}
    for i in range(config.n_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "attention.wq.weight": (q_dim, dim),
            p + "attention.wk.weight": (kv_dim, dim),
            p + "attention.wv.weight": (kv_dim, dim),
            p + "attention.wo.weight": (dim, q_dim),
            p + "feed_forward.w1.weight": (hidden, dim),
            p + "feed_forward.w2.weight": (dim, hidden),
            p + "feed_forward.w3.weight": (hidden, dim),
            p + "attention_norm.weight": (dim,),
            p + "ffn_norm.weight": (dim,),
        }
        if config.ssmax:
            shapes[p + "attention.seq_scale"] = per_head
        if config.per_layer_prior:
            shapes |= {f"{p}attention.prior.{leaf}": per_head for leaf in PRIOR_LEAVES}
    shapes |= {"norm.weight": (dim,), "output.weight": (config.vocab_size, dim)}
    if config.shared_prior:
        shapes |= {f"prior.{leaf}": per_head for leaf in PRIOR_LEAVES}
    return shapes


def strip_prefixes(key: str) -> str:
    """Removes the leading `module.` (DDP) and `_orig_mod.` (torch.compile) wrappers."""
    while key.startswith(KEY_PREFIXES):
        key = key.split(".", 1)[1]
    return key


def canonical_state(state: Mapping[str, Any], source: str | os.PathLike) -> dict[str, np.ndarray]:
    """Prefix-free keys with theta_* prior names; float arrays as float32 numpy."""
    out: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise ValueError(f"{source}: state dict keys must be strings, got {key!r}")
        name = _theta_name(strip_prefixes(key))
        if name in out:
            raise ValueError(f"{source}: keys {origin[name]!r} and {key!r} both give {name!r}")
        array = np.asarray(value)
        if not np.issubdtype(array.dtype, np.floating):
            raise ValueError(f"{source}: {key!r} must hold floats, got dtype {array.dtype}")
        out[name], origin[name] = array.astype(np.float32), key
    return out


def validate_reference_state(
    state: Mapping[str, np.ndarray], config: ModelConfig, source: str | os.PathLike
) -> None:
    """Raises ValueError unless `state` (canonical keys) holds exactly the config's tensors."""
    expected = reference_state_shapes(config)
    missing = [k for k in expected if k not in state]
    if missing:
        listed = ", ".join(f"{k!r} {list(expected[k])}" for k in missing[:6])
        more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        raise ValueError(
            f"{source}: missing keys for a {config.encoding} model "
            f"(global_prior={config.global_prior}): {listed}{more}"
        )
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ValueError(
            f"{source}: unexpected keys for a {config.encoding} model "
            f"(global_prior={config.global_prior}): {unexpected[:6]}"
        )
    for key, shape in expected.items():
        got = state[key].shape
        # Per-head tensors are [1, H, 1, 1] in the reference; some copies store [H, 1].
        per_head_ok = len(shape) == 4 and _squeezed(got) == (config.n_heads,)
        if got != shape and not per_head_ok:
            raise ValueError(f"{source}: {key!r} has shape {list(got)}, expected {list(shape)}")


# --------------------------------------------------------------------------- exporting


def export_reference_checkpoint(
    model: Transformer,
    config: ModelConfig,
    run_dir: str | os.PathLike,
    *,
    fmt: Literal["pt", "npz"] = "pt",
    prior_naming: PriorNaming = "theta",
) -> Path:
    """Writes `args.json` and `model.pt` / `model.npz` in the reference layout; returns the
    weights path. prior_naming: "theta" (prior.theta_*) or "legacy" (prior.shape/scale/loc).
    Each file is written to a temporary name and renamed, so readers never see half a file.
    """
    if fmt not in ("pt", "npz"):
        raise ValueError(f"fmt must be 'pt' or 'npz', got {fmt!r}")
    if prior_naming not in ("theta", "legacy"):
        raise ValueError(f"prior_naming must be 'theta' or 'legacy', got {prior_naming!r}")
    run_args = reference_args(config, prior_naming=prior_naming)
    state = reference_state_dict(model, config, prior_naming=prior_naming)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    weights_path = run_dir / (TORCH_FILE if fmt == "pt" else NUMPY_FILE)
    if fmt == "pt":
        torch = _import_torch()
        tensors = {k: torch.from_numpy(np.array(v, order="C")) for k, v in state.items()}
        write_atomically(weights_path, lambda f: torch.save(tensors, f))
    else:
        write_atomically(weights_path, lambda f: np.savez(f, **state))
    text = json.dumps(run_args, indent=4).encode()
    write_atomically(run_dir / ARGS_FILE, lambda f: f.write(text))
    return weights_path


def reference_state_dict(
    model: Transformer, config: ModelConfig, *, prior_naming: PriorNaming = "theta"
) -> dict[str, np.ndarray]:
    """The model's parameters as a reference state dict of float32 numpy arrays."""
    state: dict[str, np.ndarray] = {}
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        value = np.asarray(jax.device_get(variable.get_value()), np.float32)
        keys = _reference_paths(path, config.n_layers)
        layer_values = list(value) if _is_scanned(path) else [value]
        for key, layer_value in zip(keys, layer_values, strict=True):
            state[_reference_leaf(key)] = _to_reference_layout(key, layer_value, config)
    validate_reference_state(state, config, "model")
    if prior_naming == "legacy":
        state = {_legacy_name(k): v for k, v in state.items()}
    return state


def reference_args(config: ModelConfig, *, prior_naming: PriorNaming = "theta") -> dict:
    """The args.json dictionary the reference code reads for `config`."""
    if config.ssmax_capped_layers:
        raise ValueError(
            f"ssmax_capped_layers={config.ssmax_capped_layers}: the reference code has no cap "
            "on SSMax's key count, so it would compute other logits past max_seq_len; "
            "export a model with ssmax_capped_layers=0"
        )
    if config.local_layers:
        raise ValueError(
            f"local_layers={config.local_layers}: the reference code has no sliding-window "
            "layers beside its global ones; export a model with local_layers=0"
        )
    window = config.window
    model_args: dict[str, Any] = {
        "dim": config.dim,
        "n_layers": config.n_layers,
        "n_heads": config.n_heads,
        "n_kv_heads": config.n_kv_heads,
        "vocab_size": config.vocab_size,
        "multiple_of": config.multiple_of,
        "ffn_dim_multiplier": config.ffn_dim_multiplier,
        "norm_eps": config.norm_eps,
        "max_batch_size": 32,
        # The reference's rope_local masks keys farther than max_seq_len.
        "max_seq_len": config.max_seq_len if window is None else window,
    }
    positional = config.positional
    if positional.rotary:
        model_args["rope_theta"] = config.rope_theta
    if positional.absolute:
        model_args["sinusoidal_theta"] = config.sinusoidal_theta
    if positional.learned_prior:
        model_args |= _reference_prior_args(config, prior_naming)
    if config.ssmax:
        model_args["seq_scale"] = config.train_ssmax_scale
    if positional.learned_prior and positional.ssmax:
        model_args["ssmax_prior"] = config.ssmax_prior_inside
    return {
        "args": {"position_encoding": TO_REFERENCE_ENCODING[config.encoding]},
        "model_args": model_args,
    }


# --------------------------------------------------------------------------- helpers


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as error:
        raise ImportError(
            "reading or writing model.pt needs PyTorch: pip install 'bam-jax[torch]' "
            "(or convert the state dict to model.npz)"
        ) from error
    return torch


def _weights_path(run_dir: Path, weights: str | None) -> Path:
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: not a directory (expected a reference run directory)")
    if weights is not None:
        if weights not in (TORCH_FILE, NUMPY_FILE):
            raise ValueError(f"weights must be {TORCH_FILE!r} or {NUMPY_FILE!r}, got {weights!r}")
        candidates = [run_dir / weights]
    else:
        candidates = [run_dir / name for name in (TORCH_FILE, NUMPY_FILE)]
    present = [path for path in candidates if path.is_file()]
    if not present:
        names = " or ".join(path.name for path in candidates)
        raise ValueError(f"{run_dir}: no weights file ({names})")
    if len(present) > 1:
        raise ValueError(
            f"{run_dir}: both {TORCH_FILE} and {NUMPY_FILE} are present; pass weights= to choose"
        )
    return present[0]


def _read_weights(path: Path) -> Mapping[str, Any]:
    if path.suffix == ".npz":
        if path.stat().st_size == 0:
            raise ValueError(f"{path}: the file is empty (0 bytes); copy or export it again")
        if not zipfile.is_zipfile(path):
            raise ValueError(
                f"{path}: not a .npz archive (a zip of .npy arrays); the file is damaged or "
                "of another format"
            )
        try:
            with np.load(path, allow_pickle=False) as data:
                return {key: data[key] for key in data.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
            raise ValueError(f"{path}: not a readable .npz archive ({error})") from error
    torch = _import_torch()
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise ValueError(f"{path}: not a readable torch state dict ({error})") from error
    if not isinstance(state, Mapping):
        raise ValueError(f"{path}: expected a state dict (a mapping), got {type(state).__name__}")
    arrays = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{path}: {key!r} is a {type(value).__name__}, expected a tensor")
        arrays[key] = value.detach().cpu().to(torch.float32).numpy()
    return arrays


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


def _reference_prior_args(config: ModelConfig, naming: PriorNaming) -> dict[str, Any]:
    alpha = config.prior_alpha_init
    if naming == "legacy":
        return {
            "shape_init": config.prior_beta_init,
            "scale_init": alpha,
            "loc_init": config.prior_mu_init,
            "train_shape": config.train_prior_beta,
            "train_scale": config.train_prior_alpha,
            "train_loc": config.train_prior_mu,
            "global_positional_encoding": config.global_prior,
        }
    return {
        # The reference's own (misspelt) field name.
        "thata_beta_init": config.prior_beta_init,
        "theta_alpha_init": alpha if isinstance(alpha, str) else math.log(alpha),
        "theta_mu_init": config.prior_mu_init,
        "train_theta_beta": config.train_prior_beta,
        "train_theta_alpha": config.train_prior_alpha,
        "train_theta_mu": config.train_prior_mu,
        "global_positional_encoding": config.global_prior,
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
    if not isinstance(value, int) or isinstance(value, bool):
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


def _theta_name(key: str) -> str:
    head, _, leaf = key.rpartition(".")
    if (head == "prior" or head.endswith(".prior")) and leaf in LEGACY_PRIOR_LEAVES:
        return f"{head}.{LEGACY_PRIOR_LEAVES[leaf]}"
    return key


def _legacy_name(key: str) -> str:
    head, _, leaf = key.rpartition(".")
    if (head == "prior" or head.endswith(".prior")) and leaf in TO_LEGACY_PRIOR_LEAVES:
        return f"{head}.{TO_LEGACY_PRIOR_LEAVES[leaf]}"
    return key


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(n for n in shape if n != 1) or (1,)


def _reference_leaf(path: tuple[str, ...]) -> str:
    """Our variable path (layer index included) -> the reference key."""
    *head, leaf = path
    leaf = {"kernel": "weight", "embedding": "weight"}.get(leaf, leaf)
    return ".".join([*head, leaf])


def _is_per_head(key: tuple[str, ...]) -> bool:
    return key[-1] == "seq_scale" or (len(key) > 1 and key[-2] == "prior")


def _to_reference_layout(key: tuple[str, ...], value: np.ndarray, config: ModelConfig):
    if key[-1] == "kernel":
        return np.ascontiguousarray(value.T)
    if _is_per_head(key):
        return value.reshape(1, config.n_heads, 1, 1)
    return value


def _from_reference_layout(key: tuple[str, ...], value: np.ndarray) -> np.ndarray:
    if key[-1] == "kernel":
        return np.ascontiguousarray(value.T)
    if _is_per_head(key):
        return value.reshape(-1)
    return value


def _reference_paths(path: tuple, n_layers: int) -> list[tuple[str, ...]]:
    """Our flat variable path -> the reference path of each layer it holds. Scanned layers
    are one variable with a leading layer axis; the reference spells them `layers.{i}`."""
    names = tuple(str(p) for p in path)
    if _is_scanned(path):
        return [("layers", str(i), *names[1:]) for i in range(n_layers)]
    return [names]


def _is_scanned(path: tuple) -> bool:
    return str(path[0]) == "layers" and not isinstance(path[1], int)


def _build_model(config: ModelConfig, state: Mapping[str, np.ndarray]) -> Transformer:
    """Fills an abstract (never initialised) Transformer with the reference tensors."""
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    values: dict[tuple, Any] = {}
    for path, variable in nnx.to_flat_state(abstract_state):
        slices = [
            _from_reference_layout(key, state[_reference_leaf(key)])
            for key in _reference_paths(path, config.n_layers)
        ]
        array = np.stack(slices) if _is_scanned(path) else slices[0]
        if array.shape != variable.shape:
            raise RuntimeError(f"{path}: built {array.shape}, the model has {variable.shape}")
        values[path] = jnp.asarray(array, variable.dtype)
    nnx.replace_by_pure_dict(abstract_state, _nested(values))
    return nnx.merge(graphdef, abstract_state)


def _nested(flat: Mapping[tuple, Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return tree
