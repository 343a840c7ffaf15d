"""Reference-format runs (args.json and weights) of small models of every encoding, as the
authors' code writes them, for the import tests."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from bam_jax.reference_checkpoint import NUMPY_FILE

TOL = 1e-4
DIM, LAYERS, HEADS, VOCAB, LENGTH = 32, 2, 4, 64, 17
SEQ_CODES_BxT = np.array([[0] * 5 + [1] * 7 + [2] * 5, [3] * 10 + [4] * 7], np.int32)
PREFIXES = ("", "module.", "_orig_mod.", "module._orig_mod.")
LEGACY = {"theta_alpha": "scale", "theta_beta": "shape", "theta_mu": "loc"}


@dataclasses.dataclass(frozen=True)
class Case:
    encoding: str  # the reference's position_encoding name
    global_prior: bool = True
    legacy_names: bool = False
    n_kv_heads: int | None = None
    ffn_dim_multiplier: float | None = 2.0
    multiple_of: int = 1
    max_seq_len: int = 8  # < LENGTH: rope_local's window masks, tables are recomputed
    prefix: str = ""

    @property
    def id(self) -> str:
        parts = [self.encoding]
        if self.encoding.startswith("bam"):
            parts += ["global" if self.global_prior else "layer"]
            parts += ["legacy" if self.legacy_names else "theta"]
        if self.n_kv_heads:
            parts.append(f"gqa{self.n_kv_heads}")
        if self.ffn_dim_multiplier is None:
            parts.append("ffn_none")
        return "-".join(parts)


def _cases() -> list[Case]:
    cases = [
        Case(name)
        for name in (
            "nope",
            "nope_ssmax",
            "sinusoidal",
            "sinusoidal_ssmax",
            "rotary",
            "rotary_ssmax",
            "rotary_local",
            "alibi",
            "alibi_ssmax",
        )
    ]
    cases += [
        Case(name, global_prior=g, legacy_names=legacy)
        for name in ("bam", "bam_ssmax")
        for g in (True, False)
        for legacy in (False, True)
    ]
    cases += [
        Case("bam_ssmax", global_prior=False, n_kv_heads=2),
        Case("rotary", ffn_dim_multiplier=None, multiple_of=24, max_seq_len=32),
    ]
    return [dataclasses.replace(c, prefix=PREFIXES[i % len(PREFIXES)]) for i, c in enumerate(cases)]


CASES = _cases()


def make_run(case: Case, seed: int = 0) -> tuple[dict, dict[str, np.ndarray]]:
    """(args.json dict, state dict in the torch layout with prefixed keys)."""
    rng = np.random.default_rng(seed)
    kv_heads = case.n_kv_heads or HEADS
    head_dim = DIM // HEADS
    hidden = DIM if case.ffn_dim_multiplier is None else int(case.ffn_dim_multiplier * DIM)
    hidden = case.multiple_of * math.ceil(hidden / case.multiple_of)

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        bound = 1 / math.sqrt(in_dim)
        return rng.uniform(-bound, bound, (out_dim, in_dim)).astype(np.float32)

    def per_head(mean: float, std: float) -> np.ndarray:
        return (mean + std * rng.standard_normal((1, HEADS, 1, 1))).astype(np.float32)

    def prior(prefix: str) -> dict[str, np.ndarray]:
        values = {
            "theta_alpha": per_head(-1.0, 0.5),
            # Shapes from negative ("retrieval" heads) to above one; nonzero locations.
            "theta_beta": np.linspace(-0.6, 1.7, HEADS, dtype=np.float32).reshape(1, -1, 1, 1),
            "theta_mu": per_head(0.0, 0.5),
        }
        name = (lambda k: LEGACY[k]) if case.legacy_names else (lambda k: k)
        return {f"{prefix}prior.{name(k)}": v for k, v in values.items()}

    state = {"tok_embeddings.weight": rng.standard_normal((VOCAB, DIM)).astype(np.float32)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        state |= {
            p + "attention.wq.weight": linear(HEADS * head_dim, DIM),
            p + "attention.wk.weight": linear(kv_heads * head_dim, DIM),
            p + "attention.wv.weight": linear(kv_heads * head_dim, DIM),
            p + "attention.wo.weight": linear(DIM, HEADS * head_dim),
            p + "feed_forward.w1.weight": linear(hidden, DIM),
            p + "feed_forward.w2.weight": linear(DIM, hidden),
            p + "feed_forward.w3.weight": linear(hidden, DIM),
            p + "attention_norm.weight": (1 + 0.2 * rng.standard_normal(DIM)).astype(np.float32),
            p + "ffn_norm.weight": (1 + 0.2 * rng.standard_normal(DIM)).astype(np.float32),
        }
        if case.encoding.endswith("_ssmax"):
            state[p + "attention.seq_scale"] = per_head(1.0, 0.3)
        if case.encoding.startswith("bam") and not case.global_prior:
            state |= prior(p + "attention.")
    state |= {
        "norm.weight": (1 + 0.2 * rng.standard_normal(DIM)).astype(np.float32),
        "output.weight": linear(VOCAB, DIM),
    }
    if case.encoding.startswith("bam") and case.global_prior:
        state |= prior("")
    return _run_args(case), {case.prefix + k: v for k, v in state.items()}


def _run_args(case: Case) -> dict:
    """args.json as the reference's train.py writes it: vars() of its ModelArgs."""
    model_args = {
        "dim": DIM,
        "n_layers": LAYERS,
        "n_heads": HEADS,
        "n_kv_heads": case.n_kv_heads,
        "vocab_size": VOCAB,
        "multiple_of": case.multiple_of,
        "ffn_dim_multiplier": case.ffn_dim_multiplier,
        "norm_eps": 1e-5,
        "max_batch_size": 32,
        "max_seq_len": case.max_seq_len,
    }
    if case.encoding.startswith("rotary"):
        model_args["rope_theta"] = 500000
    if case.encoding.startswith("sinusoidal"):
        model_args["sinusoidal_theta"] = 10000
    if case.encoding.startswith("bam") and case.legacy_names:
        model_args |= {
            "shape_init": 1,
            "scale_init": "slope",
            "loc_init": 0,
            "train_shape": True,
            "train_scale": True,
            "train_loc": False,
            "global_positional_encoding": case.global_prior,
        }
    elif case.encoding.startswith("bam"):
        model_args |= {
            "thata_beta_init": "0",
            "theta_alpha_init": "0",
            "theta_mu_init": "0",
            "train_theta_beta": True,
            "train_theta_alpha": True,
            "train_theta_mu": False,
            # An unset --global_prior flag is written as null and means per-layer priors.
            "global_positional_encoding": True if case.global_prior else None,
        }
    if case.encoding.endswith("_ssmax"):
        model_args["seq_scale"] = True
    args = {"position_encoding": case.encoding, "model_size": "test", "sequence_length": 8}
    return {"args": args, "dataset_args": {}, "model_args": model_args}


def write_run(directory: Path, run_args: dict, state: dict[str, np.ndarray]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "args.json").write_text(json.dumps(run_args, indent=4))
    np.savez(directory / NUMPY_FILE, **state)
    return directory
