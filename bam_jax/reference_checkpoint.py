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

from bam_jax.config import ModelConfig
from bam_jax.io.files import write_atomically
from bam_jax.io.reference_args import (
    ARGS_FILE,
    TO_REFERENCE_ENCODING,
    read_reference_config,
)
from bam_jax.model import Transformer

TORCH_FILE = "model.pt"
NUMPY_FILE = "model.npz"
KEY_PREFIXES = ("module.", "_orig_mod.")

PRIOR_LEAVES = ("theta_alpha", "theta_beta", "theta_mu")
LEGACY_PRIOR_LEAVES = {"scale": "theta_alpha", "shape": "theta_beta", "loc": "theta_mu"}
TO_LEGACY_PRIOR_LEAVES = {theta: legacy for legacy, theta in LEGACY_PRIOR_LEAVES.items()}

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
