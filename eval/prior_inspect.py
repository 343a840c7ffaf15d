"""What a trained model learned about position: its priors per layer and head.

For BAM models: theta_alpha, theta_beta, theta_mu and mu of every head (one global prior or
one per layer), the SSMax scale per layer and head, the head class the paper discusses
(local: theta_beta > 0, the prior decays with distance; retrieval: theta_beta <= 0, flat or
growing with distance), and the bias as a function of distance. ALiBi models show their
fixed slopes; the other SSMax models only their scales.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from flax import nnx

from bam_jax.config import ModelConfig
from bam_jax.priors import alibi_slopes, ggd_bias

PRIOR_FIELDS = ("theta_alpha", "theta_beta", "theta_mu")


def head_class(theta_beta: float) -> str:
    return "local" if theta_beta > 0 else "retrieval"


def _walk(tree: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _walk(v, (*path, k))
    else:
        yield path, tree


def positional_arrays(model: nnx.Module, config: ModelConfig) -> dict[str, np.ndarray]:
    """Prior parameters and SSMax scales as arrays [L, H] (a global prior is broadcast)."""
    L, H = config.n_layers, config.n_heads
    found: dict[str, dict[Any, np.ndarray]] = {}
    for path, value in _walk(nnx.to_pure_dict(nnx.state(model))):
        name = path[-1]
        if name not in (*PRIOR_FIELDS, "seq_scale"):
            continue
        layer = next((p for p in path if isinstance(p, int)), None)
        found.setdefault(name, {})[layer] = np.asarray(value, np.float64)
    out: dict[str, np.ndarray] = {}
    for name, by_layer in found.items():
        if set(by_layer) == {None}:
            only = by_layer[None]
            out[name] = only if only.ndim == 2 else np.broadcast_to(only, (L, H)).copy()
        else:
            out[name] = np.stack([by_layer[i] for i in range(L)])
    return out


def prior_table(model: nnx.Module, config: ModelConfig) -> list[dict[str, Any]]:
    """One row per (layer, head): the prior parameters, SSMax scale and head class."""
    arrays = positional_arrays(model, config)
    positional = config.positional
    if not positional.additive_prior and "seq_scale" not in arrays:
        raise ValueError(
            f"encoding {config.encoding!r} has no positional prior or SSMax scale to inspect"
        )
    slopes = np.asarray(alibi_slopes(config.n_heads), np.float64) if positional.alibi else None
    rows = []
    for layer in range(config.n_layers):
        for head in range(config.n_heads):
            row: dict[str, Any] = {"layer": layer, "head": head}
            if positional.learned_prior:
                for name in PRIOR_FIELDS:
                    row[name] = float(arrays[name][layer, head])
                row["mu"] = float(2 * np.sinh(row["theta_mu"]))
                row["class"] = head_class(row["theta_beta"])
            elif slopes is not None:
                row["alibi_slope"] = float(slopes[head])
                row["class"] = "local"
            if "seq_scale" in arrays:
                row["ssmax_scale"] = float(arrays["seq_scale"][layer, head])
            rows.append(row)
    return rows


def prior_curves(
    config: ModelConfig, table: list[dict[str, Any]], max_distance: int, points: int = 200
) -> list[dict[str, Any]]:
    """Bias vs distance per head, one curve per distinct prior (global: layer "all")."""
    if not config.positional.additive_prior:
        return []
    distance = np.unique(np.round(np.logspace(0, np.log10(max(max_distance, 2)), points)))
    shared = _shared_prior(config)
    rows = [r for r in table if r["layer"] == 0] if shared else table
    curves = []
    for r in rows:
        if config.positional.learned_prior:
            bias = ggd_bias(
                np.float32([r["theta_alpha"]]),
                np.float32([r["theta_beta"]]),
                np.float32([r["theta_mu"]]),
                -distance.astype(np.float32),
                form=config.prior_form,
            )[0]
        else:
            bias = -r["alibi_slope"] * distance
        curves.append(
            {
                "layer": "all" if shared else r["layer"],
                "head": r["head"],
                "class": r["class"],
                "distance": distance.tolist(),
                "bias": np.asarray(bias, np.float64).tolist(),
            }
        )
    return curves


def head_classes(config: ModelConfig, table: list[dict[str, Any]]) -> dict[str, int]:
    """Number of local and retrieval heads, counting a shared prior once."""
    rows = [r for r in table if r["layer"] == 0] if _shared_prior(config) else table
    classes = [r["class"] for r in rows if "class" in r]
    return {c: classes.count(c) for c in ("local", "retrieval")} if classes else {}


def figure_table(config: ModelConfig, table: list[dict[str, Any]], max_rows: int = 48) -> list:
    """The parameter table for the figure: per head when short, else a per-layer summary."""
    rows = _global_rows(table) if _shared_prior(config) else table
    if len(rows) <= max_rows:
        return rows
    summary = []
    for layer in range(config.n_layers):
        mine = [r for r in table if r["layer"] == layer]
        entry: dict[str, Any] = {"layer": layer}
        if "theta_beta" in mine[0]:
            betas = [r["theta_beta"] for r in mine]
            entry.update(
                local=sum(b > 0 for b in betas),
                retrieval=sum(b <= 0 for b in betas),
                theta_beta_min=min(betas),
                theta_beta_max=max(betas),
            )
        if "ssmax_scale" in mine[0]:
            entry["ssmax_scale_mean"] = float(np.mean([r["ssmax_scale"] for r in mine]))
        summary.append(entry)
    return summary


def _shared_prior(config: ModelConfig) -> bool:
    """One prior for all layers: ALiBi, or BAM with a global prior."""
    return config.positional.alibi or config.shared_prior


def _global_rows(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Shared prior: one row per head, SSMax scales averaged over layers."""
    out = []
    for r in (r for r in table if r["layer"] == 0):
        row = {k: v for k, v in r.items() if k not in ("layer", "ssmax_scale")}
        row = {"layer": "all", **row}
        if "ssmax_scale" in r:
            scales = [t["ssmax_scale"] for t in table if t["head"] == r["head"]]
            row["ssmax_scale_mean"] = float(np.mean(scales))
        out.append(row)
    return out
