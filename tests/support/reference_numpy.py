"""Plain-numpy forward pass of the reference PyTorch models, used as a test oracle.

It reads a state dict in the reference (torch) layout, docs/spec.md section 8: Linear weights
[out, in], priors and SSMax scales [1, H, 1, 1], optional `module.` / `_orig_mod.` key
prefixes, and the `args.json` dictionary of a reference run directory. It follows the
reference models step by step (RMSNorm, SwiGLU, complex-pair RoPE, sinusoidal table
with the odd-index cosine frequency, ALiBi slopes, GGD prior, SSMax with n_i counted
inside the document). Where the authors' files differ:

- GGD form: their training models (models/bam.py, models/bam_ssmax.py) and their SSMax
  evaluation model (inference_models/bam_ssmax.py) compute bias = -exp(theta_alpha) *
  (|d - mu| + eps) ** theta_beta, the default here (`prior_form="training"`); their
  evaluation model without SSMax (inference_models/bam.py) computes
  -(|d - mu| * exp(theta_alpha) + eps) ** theta_beta (`prior_form="inference"`).
- bam_ssmax: `model_args.ssmax_prior` (missing: true) adds the prior before the SSMax
  scaling (true) or after it (false), in their training and evaluation models alike;
  `ssmax_prior_inside` overrides it.

Everything is computed in `dtype` (float64 by default), so the oracle is more precise
than the float32 models it checks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

GGD_EPS = 1e-5
KEY_PREFIXES = ("module.", "_orig_mod.")
SSMAX_ENCODINGS = ("nope_ssmax", "sinusoidal_ssmax", "rotary_ssmax", "alibi_ssmax", "bam_ssmax")
REFERENCE_ENCODINGS = (
    "nope",
    "sinusoidal",
    "rotary",
    "rotary_local",
    "alibi",
    "bam",
    *SSMAX_ENCODINGS,
)
# Older runs name the GGD parameters after the distribution's shape/scale/location.
LEGACY_PRIOR_NAMES = {"shape": "theta_beta", "scale": "theta_alpha", "loc": "theta_mu"}


def strip_prefixes(key: str) -> str:
    """Removes any leading `module.` / `_orig_mod.` wrappers (DDP, torch.compile)."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in KEY_PREFIXES:
            if key.startswith(prefix):
                key, stripped = key[len(prefix) :], True
    return key


def canonical_state(state: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Prefix-free keys, prior parameters under their theta_* names, numpy arrays."""
    out = {}
    for key, value in state.items():
        key = strip_prefixes(key)
        head, _, leaf = key.rpartition(".")
        if head.endswith("prior") and leaf in LEGACY_PRIOR_NAMES:
            key = f"{head}.{LEGACY_PRIOR_NAMES[leaf]}"
        out[key] = np.asarray(value)
    return out


def alibi_slopes(n_heads: int) -> np.ndarray:
    """The reference's ALiBi slopes (docs/spec.md section 3), float64 [H]."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        return np.asarray(power_of_two(n_heads))
    closest = 2 ** math.floor(math.log2(n_heads))
    extra = alibi_slopes(2 * closest)[0::2][: n_heads - closest]
    return np.concatenate([power_of_two(closest), extra])


def sinusoidal_table(length: int, dim: int, theta: float, dtype: Any) -> np.ndarray:
    """[length, dim]: sin on even channels, cos on odd channels with the odd index."""
    pos = np.arange(length, dtype=dtype)[:, None]
    sin_freq = np.exp(np.arange(0, dim, 2, dtype=dtype) * -(math.log(theta) / dim))
    cos_freq = np.exp(np.arange(1, dim, 2, dtype=dtype) * -(math.log(theta) / dim))
    table = np.zeros((length, dim), dtype)
    table[:, 0::2] = np.sin(pos * sin_freq)
    table[:, 1::2] = np.cos(pos * cos_freq)
    return table


def apply_rope(x_BxTxHxD: np.ndarray, theta: float) -> np.ndarray:
    """Rotates adjacent channel pairs (2k, 2k+1) by angle p * theta ** (-2k / D)."""
    _, t, _, d = x_BxTxHxD.shape
    freqs = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64)[: d // 2] / d)
    angle_TxR = np.outer(np.arange(t, dtype=np.float64), freqs)
    cos, sin = np.cos(angle_TxR)[None, :, None], np.sin(angle_TxR)[None, :, None]
    cos, sin = cos.astype(x_BxTxHxD.dtype), sin.astype(x_BxTxHxD.dtype)
    even, odd = x_BxTxHxD[..., 0::2], x_BxTxHxD[..., 1::2]
    out = np.empty_like(x_BxTxHxD)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def ggd_bias(
    prior: Mapping[str, np.ndarray], t: int, dtype: Any, form: str = "training"
) -> np.ndarray:
    """[H, T, S] (S = T) GGD log-prior for distance d = j - i, of either form."""
    alpha, beta, theta_mu = (
        np.asarray(prior[name], dtype).reshape(-1, 1, 1)
        for name in ("theta_alpha", "theta_beta", "theta_mu")
    )
    pos = np.arange(t, dtype=dtype)
    d_TxS = pos[None, :] - pos[:, None]
    mu = np.exp(theta_mu) - np.exp(-theta_mu)
    if form == "inference":
        return -((np.abs((d_TxS[None] - mu) * np.exp(alpha)) + GGD_EPS) ** beta)
    return -np.exp(alpha) * (np.abs(d_TxS[None] - mu) + GGD_EPS) ** beta


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def softmax(x: np.ndarray) -> np.ndarray:
    x = x - np.max(x, axis=-1, keepdims=True)
    e = np.exp(x)
    return e / np.sum(e, axis=-1, keepdims=True)


def visibility_mask(
    seq_codes_BxT: np.ndarray | None, b: int, t: int, window: int | None
) -> np.ndarray:
    """[B, T, S] (S = T) bool: query i may see key j (causal, same document, inside the window)."""
    pos = np.arange(t)
    visible = np.broadcast_to(pos[None, :] <= pos[:, None], (b, t, t))
    if window is not None:
        visible = visible & (np.abs(pos[None, :] - pos[:, None]) <= window)[None]
    if seq_codes_BxT is not None:
        codes = np.asarray(seq_codes_BxT)
        visible = visible & (codes[:, :, None] == codes[:, None, :])
    return visible


def reference_forward(
    state: Mapping[str, Any],
    run_args: Mapping[str, Any],
    tokens_BxT: np.ndarray,
    seq_codes_BxT: np.ndarray | None = None,
    *,
    dtype: Any = np.float64,
    ssmax_prior_inside: bool | None = None,
    prior_form: str = "training",
) -> np.ndarray:
    """Logits [B, T, vocab] of the reference model described by `run_args` (args.json).

    ssmax_prior_inside: None follows `model_args.ssmax_prior` as the authors' code does.
    prior_form: "training" or "inference" (the module docstring says which file has which).
    """
    encoding = run_args["args"]["position_encoding"]
    if encoding not in REFERENCE_ENCODINGS:
        raise ValueError(f"unknown position_encoding {encoding!r}")
    margs = run_args["model_args"]
    params = {k: v.astype(dtype) for k, v in canonical_state(state).items()}
    tokens = np.asarray(tokens_BxT)
    b, t = tokens.shape
    dim, n_heads = margs["dim"], margs["n_heads"]
    n_kv_heads = margs.get("n_kv_heads") or n_heads
    head_dim = dim // n_heads
    eps = margs.get("norm_eps", 1e-5)
    if ssmax_prior_inside is None:
        ssmax_prior_inside = bool(margs.get("ssmax_prior", True))

    h = params["tok_embeddings.weight"][tokens]
    if encoding.startswith("sinusoidal"):
        h = h + sinusoidal_table(t, dim, margs.get("sinusoidal_theta", 10_000), dtype)[None]

    window = margs["max_seq_len"] if encoding == "rotary_local" else None
    visible_Bx1xTxS = visibility_mask(seq_codes_BxT, b, t, window)[:, None]
    log_n_Bx1xTx1 = np.log(visible_Bx1xTxS.sum(-1, keepdims=True).astype(dtype))

    def layer_prior(prefix: str) -> np.ndarray:
        keys = ("theta_alpha", "theta_beta", "theta_mu")
        if f"{prefix}prior.theta_alpha" not in params:
            prefix = ""
        return ggd_bias({k: params[f"{prefix}prior.{k}"] for k in keys}, t, dtype, prior_form)

    for layer in range(margs["n_layers"]):
        p = f"layers.{layer}."
        x = rms_norm(h, params[p + "attention_norm.weight"], eps)
        q = (x @ params[p + "attention.wq.weight"].T).reshape(b, t, n_heads, head_dim)
        k = (x @ params[p + "attention.wk.weight"].T).reshape(b, t, n_kv_heads, head_dim)
        v = (x @ params[p + "attention.wv.weight"].T).reshape(b, t, n_kv_heads, head_dim)
        if encoding.startswith("rotary"):
            theta = margs.get("rope_theta", 500_000)
            q, k = apply_rope(q, theta), apply_rope(k, theta)
        # Grouped-query heads as the reference's repeat_kv: kv head g serves q heads g*r..g*r+r-1.
        k = np.repeat(k, n_heads // n_kv_heads, axis=2)
        v = np.repeat(v, n_heads // n_kv_heads, axis=2)
        scores = np.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(head_dim)

        bias_HxTxS = np.zeros((n_heads, t, t), dtype)
        if encoding.startswith("alibi"):
            pos = np.arange(t, dtype=dtype)
            dist = np.abs(pos[None, :] - pos[:, None])
            bias_HxTxS = -dist[None] * alibi_slopes(n_heads).astype(dtype)[:, None, None]
        elif encoding.startswith("bam"):
            bias_HxTxS = layer_prior(p + "attention.")

        if encoding in SSMAX_ENCODINGS:
            scale_BxHxTx1 = log_n_Bx1xTx1 * params[p + "attention.seq_scale"].reshape(
                1, n_heads, 1, 1
            )
            if encoding == "bam_ssmax" and ssmax_prior_inside:
                scores = (scores + bias_HxTxS[None]) * scale_BxHxTx1
            else:
                scores = scores * scale_BxHxTx1 + bias_HxTxS[None]
        else:
            scores = scores + bias_HxTxS[None]
        scores = np.where(visible_Bx1xTxS, scores, -np.inf)
        attn = np.einsum("bhij,bjhd->bihd", softmax(scores), v).reshape(b, t, dim)
        h = h + attn @ params[p + "attention.wo.weight"].T

        x = rms_norm(h, params[p + "ffn_norm.weight"], eps)
        gate = x @ params[p + "feed_forward.w1.weight"].T
        up = x @ params[p + "feed_forward.w3.weight"].T
        h = h + (gate / (1.0 + np.exp(-gate)) * up) @ params[p + "feed_forward.w2.weight"].T

    h = rms_norm(h, params["norm.weight"], eps)
    return h @ params["output.weight"].T
