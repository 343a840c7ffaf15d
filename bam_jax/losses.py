"""Cross-entropy through the output projection, a chunk of positions at a time.

`output_cross_entropy(hidden_BxTxE, kernel_ExV, targets_BxT, weights_BxT)` is
sum(weights * cross_entropy(hidden @ kernel, targets)) without ever holding the
[B, T, V] logits: positions are processed in chunks of about `chunk_tokens` tokens, and
under differentiation each chunk's gradients (softmax - one-hot, then the two matmuls)
are computed in the same pass as its loss, so the logits are neither stored for the
backward pass nor recomputed. Memory for the loss is one chunk's [chunk, V] float32
logits instead of the whole batch's, which at the paper's micro-batch (64 x 512 tokens,
V = 32768) is 128 MiB instead of 4 GiB; on a CPU it also halves the step time of the
output layer against the autodiff of a [B, T, V] projection.

Precision: the projection multiplies in `compute_dtype` and accumulates in float32 (the
model's output layer); log-sum-exp, softmax and the loss are float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

# Tokens per chunk: the fastest chunk measured for V = 32768 (docs/benchmarks.md), and 128 MiB
# of float32 logits at that vocabulary.
DEFAULT_CHUNK_TOKENS = 1024


def output_cross_entropy(
    hidden_BxTxE: jax.Array,
    kernel_ExV: jax.Array,
    targets_BxT: jax.Array,
    weights_BxT: jax.Array,
    *,
    compute_dtype: jnp.dtype | str = jnp.float32,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> jax.Array:
    """float32 sum over positions of weights * (logsumexp(logits) - logits[target]),
    logits = hidden @ kernel.

    Differentiable in hidden, kernel and weights. Targets must lie in [0, V). Chunks run
    along T (whole rows of the batch axis stay together, so a batch sharded over devices
    stays sharded); T is padded with zero-weight positions to a whole number of chunks.
    """
    batch, length, width = hidden_BxTxE.shape
    if kernel_ExV.shape[0] != width:
        raise ValueError(
            f"kernel_ExV {kernel_ExV.shape} must have the hidden width {width} as its first axis"
        )
    if targets_BxT.shape != (batch, length) or weights_BxT.shape != (batch, length):
        raise ValueError(
            f"targets_BxT {targets_BxT.shape} and weights_BxT {weights_BxT.shape} must both be "
            f"{(batch, length)}, the hidden states' [batch, length]"
        )
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    chunk_len = max(1, min(length, chunk_tokens // max(batch, 1)))
    return _cross_entropy_sum(
        hidden_BxTxE,
        kernel_ExV,
        targets_BxT.astype(jnp.int32),
        weights_BxT.astype(jnp.float32),
        jnp.dtype(compute_dtype).name,
        chunk_len,
    )


def _chunked(x_BxT: jax.Array, chunk_len: int, fill) -> jax.Array:
    """[B, T, ...] -> [T' / C, B, C, ...], T padded with `fill` to T' = a multiple of C."""
    pad = -x_BxT.shape[1] % chunk_len
    if pad:
        widths = [(0, 0)] * x_BxT.ndim
        widths[1] = (0, pad)
        x_BxT = jnp.pad(x_BxT, widths, constant_values=fill)
    batch, length = x_BxT.shape[:2]
    x = x_BxT.reshape(batch, length // chunk_len, chunk_len, *x_BxT.shape[2:])
    return jnp.swapaxes(x, 0, 1)


def _unchunked(x_ZxBxC: jax.Array, length: int) -> jax.Array:
    """Inverse of `_chunked`: [T' / C, B, C, ...] -> [B, T, ...]."""
    x = jnp.swapaxes(x_ZxBxC, 0, 1)
    x = x.reshape(x.shape[0], -1, *x.shape[3:])
    return x[:, :length]


def _chunk_cross_entropy(logits_NxV: jax.Array, targets_N: jax.Array):
    """Unweighted cross-entropy [N] and log-sum-exp [N, 1] of float32 logits."""
    row_max = lax.stop_gradient(jnp.max(logits_NxV, axis=-1, keepdims=True))
    lse_Nx1 = row_max + jnp.log(jnp.sum(jnp.exp(logits_NxV - row_max), axis=-1, keepdims=True))
    target_logit_N = jnp.take_along_axis(logits_NxV, targets_N[:, None], axis=-1)[:, 0]
    return lse_Nx1[:, 0] - target_logit_N, lse_Nx1


def _scan_chunks(
    hidden_BxTxE, kernel_ExV, targets_BxT, weights_BxT, compute_dtype, chunk_len, *, grads: bool
):
    """Unweighted cross-entropy [B, T] and, with `grads`, the gradients of the weighted sum
    in hidden [B, T, E] and kernel [E, V] (in their dtypes; float32 accumulation)."""
    length, width = hidden_BxTxE.shape[1:]
    kernel = kernel_ExV.astype(compute_dtype)
    xs = (
        _chunked(hidden_BxTxE, chunk_len, 0),
        _chunked(targets_BxT, chunk_len, 0),
        _chunked(weights_BxT, chunk_len, 0.0),
    )

    def chunk(d_kernel_ExV, x):
        h_BxCxE, t_BxC, w_BxC = x
        h_NxE = h_BxCxE.reshape(-1, width).astype(compute_dtype)
        t_N, w_N = t_BxC.reshape(-1), w_BxC.reshape(-1)
        logits_NxV = lax.dot(h_NxE, kernel, preferred_element_type=jnp.float32)
        ce_N, lse_Nx1 = _chunk_cross_entropy(logits_NxV, t_N)
        if not grads:
            return d_kernel_ExV, (ce_N.reshape(t_BxC.shape), None)
        one_hot_NxV = t_N[:, None] == lax.broadcasted_iota(jnp.int32, logits_NxV.shape, 1)
        d_logits_NxV = (jnp.exp(logits_NxV - lse_Nx1) - one_hot_NxV) * w_N[:, None]
        d_logits_NxV = d_logits_NxV.astype(compute_dtype)
        d_h_NxE = lax.dot(d_logits_NxV, kernel.T, preferred_element_type=jnp.float32)
        # A transpose XLA may not fold into the product: on a CPU, [E, N] @ [N, V] runs
        # faster than the same product contracting both operands' first axes.
        h_ExN = lax.optimization_barrier(h_NxE.T)
        d_kernel_ExV = d_kernel_ExV + lax.dot(
            h_ExN, d_logits_NxV, preferred_element_type=jnp.float32
        )
        d_h_BxCxE = d_h_NxE.reshape(h_BxCxE.shape).astype(hidden_BxTxE.dtype)
        return d_kernel_ExV, (ce_N.reshape(t_BxC.shape), d_h_BxCxE)

    init = jnp.zeros(kernel.shape, jnp.float32) if grads else None
    d_kernel_ExV, (ce_ZxBxC, d_h_ZxBxCxE) = lax.scan(chunk, init, xs)
    ce_BxT = _unchunked(ce_ZxBxC, length)
    if not grads:
        return ce_BxT, None, None
    return ce_BxT, _unchunked(d_h_ZxBxCxE, length), d_kernel_ExV.astype(kernel_ExV.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _cross_entropy_sum(
    hidden_BxTxE, kernel_ExV, targets_BxT, weights_BxT, compute_dtype, chunk_len
):
    ce_BxT = _scan_chunks(
        hidden_BxTxE, kernel_ExV, targets_BxT, weights_BxT, compute_dtype, chunk_len, grads=False
    )[0]
    return jnp.sum(ce_BxT * weights_BxT)


def _cross_entropy_fwd(
    hidden_BxTxE, kernel_ExV, targets_BxT, weights_BxT, compute_dtype, chunk_len
):
    ce_BxT, d_hidden, d_kernel = _scan_chunks(
        hidden_BxTxE, kernel_ExV, targets_BxT, weights_BxT, compute_dtype, chunk_len, grads=True
    )
    return jnp.sum(ce_BxT * weights_BxT), (d_hidden, d_kernel, ce_BxT)


def _cross_entropy_bwd(compute_dtype, chunk_len, residuals, g):
    d_hidden, d_kernel, ce_BxT = residuals
    return (
        (g * d_hidden).astype(d_hidden.dtype),
        (g * d_kernel).astype(d_kernel.dtype),
        None,
        g * ce_BxT,
    )


_cross_entropy_sum.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)
