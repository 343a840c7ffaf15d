"""A model as a Hugging Face style folder: `model.safetensors` and `config.json`.

The safetensors file holds every variable of the NNX model (parameters, prior parameters,
SSMax scales and frozen prior constants) in float32 under its dotted path, e.g.
`layers.0.attention.wq.kernel`; `config.json` holds the `ModelConfig` fields plus
`model_type` "bam". `export_model` writes the folder, `import_model` reads it back into a
Transformer. Needs the `safetensors` package (extra `hf`).

    python -m bam_jax.io.export WORKDIR OUT [--step N]   # a bam-train run's checkpoint
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import nnx, traverse_util

from bam_jax.config import ModelConfig
from bam_jax.io.checkpoints import load_params
from bam_jax.io.files import write_atomically, write_text_atomically
from bam_jax.model import Transformer

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
MODEL_TYPE = "bam"


def export_model(model: Transformer, config: ModelConfig, out_dir: str) -> str:
    """Write `model` and `config` to `out_dir` (created if needed); returns `out_dir`."""
    safetensors_numpy = _safetensors_numpy()
    tensors = {_name(path): np.asarray(value, np.float32) for path, value in _flat_state(model)}
    os.makedirs(out_dir, exist_ok=True)
    metadata = {"format": "np", "model_type": MODEL_TYPE}
    weights = safetensors_numpy.save(tensors, metadata=metadata)
    write_atomically(os.path.join(out_dir, WEIGHTS_FILE), lambda handle: handle.write(weights))
    config_json = {"model_type": MODEL_TYPE, **config.to_dict()}
    write_text_atomically(os.path.join(out_dir, CONFIG_FILE), json.dumps(config_json, indent=2))
    return out_dir


def import_model(folder: str) -> tuple[ModelConfig, Transformer]:
    """The config and model of a folder written by `export_model`."""
    config_path, weights_path = (os.path.join(folder, f) for f in (CONFIG_FILE, WEIGHTS_FILE))
    for path in (config_path, weights_path):
        if not os.path.isfile(path):
            raise ValueError(f"{folder}: no {os.path.basename(path)} (written by export_model)")
    with open(config_path, encoding="utf-8") as f:
        fields = json.load(f)
    if fields.pop("model_type", None) != MODEL_TYPE:
        raise ValueError(f"{config_path}: model_type is not {MODEL_TYPE!r}")
    config = ModelConfig.from_dict(fields)
    tensors = _safetensors_numpy().load_file(weights_path)
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = _flat_state(abstract)
    _check_names_and_shapes(weights_path, {_name(p): value.shape for p, value in flat}, tensors)
    loaded = traverse_util.unflatten_dict({path: tensors[_name(path)] for path, _ in flat})
    nnx.replace_by_pure_dict(state, loaded)
    return config, nnx.merge(graphdef, state)


def _safetensors_numpy():
    if importlib.util.find_spec("safetensors") is None:
        raise ValueError(
            "safetensors export needs the `safetensors` package (pip install 'bam-jax[hf]')"
        )
    import safetensors.numpy

    return safetensors.numpy


def _flat_state(model: nnx.Module) -> list[tuple[tuple, Any]]:
    return [(path, variable.get_value()) for path, variable in nnx.to_flat_state(nnx.state(model))]


def _name(path: tuple) -> str:
    return ".".join(str(key) for key in path)


def _check_names_and_shapes(
    path: str, expected: dict[str, tuple[int, ...]], tensors: dict[str, np.ndarray]
) -> None:
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ValueError(
            f"{path}: tensors do not match the config's model (missing {missing[:5]}, "
            f"unexpected {extra[:5]})"
        )
    for name, shape in expected.items():
        if tensors[name].shape != tuple(shape):
            raise ValueError(
                f"{path}: tensor {name} has shape {tensors[name].shape}, the config's model "
                f"needs {tuple(shape)}"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bam_jax.io.export",
        description="Export a bam-train run's checkpoint as model.safetensors + config.json.",
    )
    parser.add_argument("workdir", help="the run's --workdir")
    parser.add_argument("out", help="folder to write")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    args = parser.parse_args(argv)
    try:
        saved = load_params(args.workdir, args.step)
        export_model(saved.model(), saved.config, args.out)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"step {saved.step} of {args.workdir} written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
