"""Fused causal attention with the positional prior computed inside the kernel.

Two Pallas forward kernels share the tile math of bam_jax/kernels/tile_math.py and differ
only in how tiles reach it:

- "gpu" (Triton lowering, bam_jax/kernels/gpu.py): grid (query blocks, batch, heads);
  each program keeps its query tile and loops over key blocks up to the causal diagonal
  with `lax.fori_loop`. The prior depends only on k_pos - q_pos, so with
  block_q = m * block_k each GGD tile is evaluated once and reused by the m query
  sub-blocks (m times fewer exp2/log2).
- "tpu" (Mosaic lowering, bam_jax/kernels/tpu.py): grid (batch, heads, query blocks,
  key blocks); the running max, sum and accumulator live in VMEM scratch across the
  key-block axis, and the key index map is clamped to the visible band so skipped blocks
  are never fetched.

On CPU, where Pallas does not lower, the same function is a native kernel
("cpu", bam_jax/kernels/cpu_attention.cc through XLA FFI, compiled on first use): the same
log2 logits, table prior and online softmax, one task per (batch row, kv head, up to 8
blocks of 64 queries) sharing each 256-key tile, with the blockwise backward. Calls of fewer
than CPU_MIN_QUERIES queries (decode steps) run blockwise attention instead, which is
faster there than a kernel computing whole 64-query blocks.

Logits are formed in log2 units (softmax via exp2) and in float32. The GGD prior
-exp(theta_alpha) * (|d - mu| + eps) ** theta_beta and ALiBi -slope * |d| are evaluated
per tile from positions (distances from float iotas, one log2 and one exp2 per GGD
element, the saturation limit precomputed per head); nothing of size T x S is built.
With `prior_table=True` (and for any other Prior, the GGD prior's inference form included)
the prior is instead evaluated once per
head on every distance, a table [H, S + T - 1] computed by `prior.bias` outside the
kernel, and each tile reads its Toeplitz slice of it (a gather on GPU, a strided lane
rotation on TPU): no transcendental per element for the prior. On CPU a causal window
over a long key array is first cut to the whole 256-key tiles it can reach
(`bam_jax.masking.window_keys`), so a local layer's table, counts and tiles cost
O(window + T) per call however long the cache is. SSMax uses n_i, the
number of keys query i can see, computed outside the kernel in O((T + S) log S).

The backward pass is a custom VJP on the kernel's output and log-sum-exp. backward="fused"
(the default on GPU) runs the Triton backward kernels of bam_jax/kernels/gpu_backward.py:
one kernel for dK/dV, one for dQ and the prior's and SSMax's gradients, the latter as
per-program partial sums (deterministic, no atomics). backward="blockwise" (the default
on TPU, which has no fused backward yet) runs the blockwise implementation's flash-style
backward (`bam_jax.blockwise.flash_backward`), the pure-JAX reference.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from bam_jax.attention_inputs import AttentionInputs, checked_attention, keys_in_window
from bam_jax.attention_spec import AttentionSpec
from bam_jax.blockwise import attend_blockwise, flash_backward
from bam_jax.kernels.backend import BLOCKWISE_BACKWARD_BLOCK, FusedBackend
from bam_jax.kernels.cpu import cpu_forward
from bam_jax.kernels.gpu import gpu_forward
from bam_jax.kernels.gpu_backward import fused_gpu_backward
from bam_jax.kernels.partitioning import (
    FORWARD_OPERAND_ROLES,
    FORWARD_RESULT_ROLES,
    kernel_operand,
    offset_operand,
    partitioned_by_batch_and_heads,
)
from bam_jax.kernels.prior_table import prior_table as prior_table_of
from bam_jax.kernels.registry import FUSED_BACKENDS
from bam_jax.kernels.tile_math import (
    BETA,
    COEF,
    LIMIT,
    MU,
    NUM_HEAD_PARAMS,
    SSMAX_SCALE,
    Backend,
    DerivedInputs,
    KernelConfig,
    ggd_limit,
    pad_to,
)
from bam_jax.kernels.tpu import tpu_forward
from bam_jax.masking import log_visible_count
from bam_jax.priors import AlibiPrior, GGDPrior, Prior, ggd_mu
from bam_jax.pytrees import vary_together

Backward = Literal["fused", "blockwise"]
# The fused backward's operands (q, k, v, head params, log_n, q segments, k segments,
# offset, output, log-sum-exp, output cotangent) and results (dq, dk, dv, the head
# parameters' gradient by batch row), for bam_jax.kernels.partitioning.
BACKWARD_OPERAND_ROLES = (
    *FORWARD_OPERAND_ROLES[:3],
    *FORWARD_OPERAND_ROLES[4:],
    *FORWARD_RESULT_ROLES,
    FORWARD_RESULT_ROLES[0],
)
BACKWARD_RESULT_ROLES = (*FORWARD_OPERAND_ROLES[:3], ("batch", "heads", None))


def attend_fused(
    query_BxTxHxD: jax.Array,
    key_BxSxKxD: jax.Array,
    value_BxSxKxD: jax.Array,
    spec: AttentionSpec,
    inputs: AttentionInputs,
    *,
    backend: Backend | None = None,
    interpret: bool = False,
    approx_math: bool = True,
    prior_reuse: bool = True,
    prior_table: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
    debug: bool = False,
    backward: Backward | None = None,
) -> jax.Array:
    """Attention output [B, T, H, D], the same function as `reference_attention`.

    backend: "gpu", "tpu" or "cpu"; None picks the running platform. An explicit backend
        is trusted, so the kernel can be lowered for another platform (`jax.jit(f).trace(...)
        .lower(lowering_platforms=("tpu",))`). "cpu" is the native kernel (a C++ compiler
        is needed on first use; tiles fixed at CPU_BLOCK_Q x CPU_BLOCK_K, block_q and
        block_k ignored, prior always read from its table; fewer than CPU_MIN_QUERIES
        queries run `blockwise_attention`, the same function). To run a Pallas kernel on CPU
        pass backend "gpu" or "tpu" and `interpret=True` (Pallas interpret mode).
    spec.block_q, spec.block_k: tile sizes (None = the backend's default for the head dim,
        GPU_DEFAULTS / TPU_DEFAULT_BLOCK_*). On GPU powers of two with
        16 <= block_q <= 256 and 16 <= block_k <= 128 (anything else raises), lowered to
        the next power of two of a shorter sequence. On TPU multiples of 8; a compiled
        key block is a multiple of 128 lanes (the keys are padded to it).
    approx_math: on a compiled GPU kernel, use the hardware approximate exp2/log2 for the
        prior and softmax (about 2 ulp). Ignored in interpret mode and on TPU.
    prior_reuse: on GPU with block_q a multiple of block_k, evaluate each GGD tile once
        and reuse it for the next query sub-block (see bam_jax/kernels/gpu.py).
    prior_table: read the prior from a per-head table over distances instead of
        evaluating it per element; always on for priors other than GGD (training form) and
        ALiBi.
    num_warps, num_stages: Triton launch parameters (None = GPU_DEFAULTS by head dim).
    debug: print the kernel's jaxpr and its Triton / Mosaic module when it is lowered.
    backward: "fused" (the Triton backward kernels, GPU only) or "blockwise"
        (`bam_jax.blockwise.flash_backward`); None picks "fused" on GPU, "blockwise" on TPU,
        CPU and for priors other than GGD and ALiBi (whose parameter gradients the fused
        kernels compute in-kernel).
    """
    fused = _resolve_backend(backend, interpret)
    _check_concrete_shapes(fused, query_BxTxHxD, key_BxSxKxD)
    batch, q_len, num_heads, head_dim = query_BxTxHxD.shape
    kv_len, num_kv_heads = key_BxSxKxD.shape[1], key_BxSxKxD.shape[2]
    block_q, block_k = fused.choose_blocks(
        interpret, head_dim, q_len, kv_len, spec.block_q, spec.block_k
    )
    prior_kind = _prior_kind(inputs.prior)
    backward = _resolve_backward(fused, backward, prior_kind)
    if q_len < fused.min_queries:
        short_call = spec.replace(block_q=fused.min_queries, block_k=fused.short_call_block_k)
        return attend_blockwise(query_BxTxHxD, key_BxSxKxD, value_BxSxKxD, short_call, inputs)
    if fused.reads_window_only:
        key_BxSxKxD, value_BxSxKxD, inputs = keys_in_window(
            key_BxSxKxD, value_BxSxKxD, spec, inputs, q_len=q_len, block_k=block_k
        )
        kv_len = key_BxSxKxD.shape[1]
    table_needed = prior_kind == "other" or fused.table_prior_only
    prior_table = prior_kind != "none" and (prior_table or table_needed)
    config = KernelConfig(
        backend=fused.name,
        interpret=interpret,
        approx_math=approx_math and not interpret and fused.approx_math,
        block_q=block_q,
        block_k=block_k,
        q_len=q_len,
        head_dim=head_dim,
        groups=num_heads // num_kv_heads,
        mask=spec.mask(kv_len),
        prior_kind=prior_kind,
        ssmax=inputs.has_ssmax,
        prior_inside=spec.ssmax_prior_inside,
        segments=inputs.has_documents,
        num_warps=num_warps,
        num_stages=num_stages,
        prior_table=prior_table,
        debug=debug,
    )
    if prior_reuse and fused.prior_reuse and prior_kind == "ggd" and not prior_table:
        config = dataclasses.replace(config, q_splits=_reuse_splits(block_q, block_k))
    inputs = _as_arrays(inputs)
    log_n_BxT = table = None
    if config.ssmax:
        counts = config.mask.visible_counts(
            q_len, inputs.query_offset, inputs.query_segment_ids_BxT, inputs.key_segment_ids_BxS
        )
        log_n = log_visible_count(counts, inputs.ssmax_max_count)
        log_n_BxT = jnp.broadcast_to(log_n, (batch, q_len))
    if prior_table:
        table = prior_table_of(config, inputs.prior, inputs.query_offset)
    derived = DerivedInputs(log_n_BxT, table)
    return _attention(
        config, backward, spec, query_BxTxHxD, key_BxSxKxD, value_BxSxKxD, inputs, derived
    )


fused_attention = checked_attention(attend_fused, "fused_attention")


def _as_arrays(inputs: AttentionInputs) -> AttentionInputs:
    """The inputs with the query offset and the SSMax count cap as int32 arrays (what the
    kernels and the custom VJP's residuals hold)."""
    max_count = inputs.ssmax_max_count
    return inputs.replace(
        query_offset=jnp.asarray(inputs.query_offset, jnp.int32),
        ssmax_max_count=None if max_count is None else jnp.asarray(max_count, jnp.int32),
    )


def _resolve_backend(backend: Backend | None, interpret: bool) -> FusedBackend:
    if backend is None:
        platform = jax.default_backend()
        if platform not in FUSED_BACKENDS:
            raise ValueError(
                f"the fused attention kernel runs on GPU, TPU or CPU, not {platform!r}; "
                "use implementation='blockwise' (the same function)"
            )
        backend = platform
    if backend not in FUSED_BACKENDS:
        raise ValueError(f"backend must be 'gpu', 'tpu', 'cpu' or None, got {backend!r}")
    fused = FUSED_BACKENDS[backend]
    if interpret and not fused.pallas:
        raise ValueError(
            f"interpret=True runs a Pallas kernel (backend 'gpu' or 'tpu'); the {backend!r} "
            "backend is native code and has no interpret mode"
        )
    return fused


def has_symbolic_shape(*arrays: jax.Array) -> bool:
    """Whether a dimension of the arrays is symbolic (`jax.export` with shapes such as
    "b, t"), not a number."""
    return any(not isinstance(size, int) for x in arrays for size in x.shape)


def _check_concrete_shapes(fused: FusedBackend, q: jax.Array, k: jax.Array) -> None:
    if has_symbolic_shape(q, k):
        raise ValueError(
            f"the fused attention kernel ({fused.name!r} backend) needs concrete shapes and got "
            f"query {q.shape}, key {k.shape}: it cannot be exported with symbolic dimensions "
            "(jax.export's shape polymorphism): its tiles and grid are chosen from the lengths "
            "when it is traced, Pallas' Triton lowering takes no symbolic grid, and the native "
            "CPU kernel is a custom call that jax.export does not serialise; export "
            "implementation='blockwise', which computes the same function for any batch and "
            "length"
        )


def _resolve_backward(fused: FusedBackend, backward: Backward | None, prior_kind: str) -> Backward:
    if backward is None:
        return "fused" if fused.fused_backward and prior_kind != "other" else "blockwise"
    if backward not in ("fused", "blockwise"):
        raise ValueError(f"backward must be 'fused', 'blockwise' or None, got {backward!r}")
    name = fused.name.upper()
    if backward == "fused" and not fused.fused_backward:
        raise NotImplementedError(
            f"backward='fused' exists for backend='gpu' only; the {name} kernel has "
            f"no fused backward yet: use backward='blockwise' (the default on {name})"
        )
    if backward == "fused" and prior_kind == "other":
        raise NotImplementedError(
            "backward='fused' computes the gradients of GGDPrior (training form) and "
            "AlibiPrior only; use backward='blockwise' (the default for other priors)"
        )
    return backward


def _reuse_splits(block_q: int, block_k: int) -> int:
    """Query sub-blocks of block_k rows sharing GGD tiles (1: no reuse)."""
    if block_q <= block_k or block_q % block_k:
        return 1
    return block_q // block_k


def _prior_kind(prior: Prior | None) -> Literal["none", "ggd", "alibi", "other"]:
    if prior is None:
        return "none"
    # The kernels compute the training form from the parameters; the inference form goes
    # through its `bias`, as any other prior.
    if isinstance(prior, GGDPrior) and prior.form == "training":
        return "ggd"
    if isinstance(prior, AlibiPrior):
        return "alibi"
    return "other"


def _head_params(config: KernelConfig, prior: Prior | None, ssmax_scale_H, num_heads: int):
    return jax.lax.stop_gradient(_head_param_columns(config, prior, ssmax_scale_H, num_heads))


def _head_param_columns(
    config: KernelConfig, prior: Prior | None, ssmax_scale_H, num_heads: int
) -> jax.Array:
    """float32 [H, NUM_HEAD_PARAMS]: coef, beta, mu, SSMax scale, padding (differentiable)."""
    columns = [jnp.zeros((num_heads,), jnp.float32)] * NUM_HEAD_PARAMS
    if config.prior_kind == "ggd":
        columns[COEF] = jnp.exp(prior.theta_alpha_H.astype(jnp.float32))
        columns[BETA] = prior.theta_beta_H.astype(jnp.float32)
        columns[MU] = ggd_mu(prior.theta_mu_H.astype(jnp.float32))
        columns[LIMIT] = ggd_limit(prior.theta_alpha_H)
    elif config.prior_kind == "alibi":
        columns[COEF] = prior.slopes_H.astype(jnp.float32)
    if ssmax_scale_H is not None:
        columns[SSMAX_SCALE] = ssmax_scale_H.astype(jnp.float32)
    return jnp.stack(columns, axis=1)


def _forward(
    config: KernelConfig, q, k, v, inputs: AttentionInputs, derived: DerivedInputs
) -> tuple[jax.Array, jax.Array]:
    """Output [B, T, H, D] and log-sum-exp [B, H, T] (natural log, +inf for empty rows).

    Inside `jax.shard_map` a kernel's results are typed as varying over no mesh axis,
    whatever its operands vary over; they are cast to vary as their operands do, since
    each device computed its own (an output typed invariant would have its cotangent
    summed over the devices)."""
    out, lse = _kernel_forward(config, q, k, v, inputs, derived)
    prior_free = inputs.replace(prior=None, ssmax_scale_H=None)
    return vary_together((out, lse), q, k, v, prior_free, derived)


def _kernel_forward(config: KernelConfig, q, k, v, inputs: AttentionInputs, derived: DerivedInputs):
    head_params = _head_params(config, inputs.prior, inputs.ssmax_scale_H, q.shape[2])
    if not FUSED_BACKENDS[config.backend].pallas:
        out, lse = cpu_forward(config, q, k, v, inputs, derived, head_params)
        return out.astype(q.dtype), lse
    operands = (
        kernel_operand(derived.prior_table_HxX, jnp.float32),
        head_params,
        kernel_operand(derived.log_n_BxT, jnp.float32),
        kernel_operand(inputs.query_segment_ids_BxT, jnp.int32),
        kernel_operand(inputs.key_segment_ids_BxS, jnp.int32),
    )
    forward = functools.partial(_pallas_forward, config)
    if not (config.interpret and FUSED_BACKENDS[config.backend].interpret_has_callbacks):
        forward = partitioned_by_batch_and_heads(
            forward, FORWARD_OPERAND_ROLES, FORWARD_RESULT_ROLES
        )
    return forward(q, k, v, *operands, offset_operand(inputs.query_offset))


def _pallas_forward(
    config: KernelConfig,
    q_BxTxHxD,
    k_BxSxKxD,
    v_BxSxKxD,
    table_HxX,
    head_params_HxP,
    log_n_BxT,
    q_seg_BxT,
    k_seg_BxS,
    offset_1,
):
    """The Pallas forward on one shard's arrays (operands in FORWARD_OPERAND_ROLES' order;
    those that `config` does without are placeholders): output [B, T, H, D] and
    log-sum-exp [B, H, T]."""
    fused = FUSED_BACKENDS[config.backend]
    _, q_len, _, head_dim = q_BxTxHxD.shape
    q_pad, kv_pad = config.padded_q_len, config.padded_kv_len
    d_pad = pl.next_power_of_2(head_dim) if fused.pads_head_dim else head_dim
    q_p = pad_to(pad_to(q_BxTxHxD, 1, q_pad), 3, d_pad)
    k_p = pad_to(pad_to(k_BxSxKxD, 1, kv_pad), 3, d_pad)
    v_p = pad_to(pad_to(v_BxSxKxD, 1, kv_pad), 3, d_pad)
    log_n = q_seg = k_seg = None
    if config.ssmax:
        log_n = pad_to(log_n_BxT, 1, q_pad)[..., None]
    if config.segments:
        q_seg = pad_to(q_seg_BxT.astype(jnp.int32), 1, q_pad, -1)[..., None]
        k_seg = pad_to(k_seg_BxS.astype(jnp.int32), 1, kv_pad, -1)[:, None, :]
    table = table_HxX if config.prior_table else None
    run = {"gpu": gpu_forward, "tpu": tpu_forward}[config.backend]
    out, lse = run(config, q_p, k_p, v_p, head_params_HxP, log_n, q_seg, k_seg, offset_1, table)
    return out[:, :q_len, :, :head_dim], lse[:, :, :q_len, 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attention(
    config: KernelConfig,
    backward: Backward,
    spec: AttentionSpec,
    q,
    k,
    v,
    inputs: AttentionInputs,
    derived: DerivedInputs,
):
    return _forward(config, q, k, v, inputs, derived)[0]


def _attention_fwd(
    config: KernelConfig,
    backward: Backward,
    spec: AttentionSpec,
    q,
    k,
    v,
    inputs: AttentionInputs,
    derived: DerivedInputs,
):
    out, lse = _forward(config, q, k, v, inputs, derived)
    return out, (q, k, v, inputs, derived, out, lse)


def _attention_bwd(config: KernelConfig, backward: Backward, spec: AttentionSpec, residuals, d_out):
    q, k, v, inputs, _, out, lse = residuals
    if backward == "fused":
        dq, dk, dv, d_prior, d_scale = _fused_backward(config, residuals, d_out)
    else:
        dq, dk, dv, d_prior, d_scale = flash_backward(
            q, k, v, spec, inputs, out, lse, d_out, block=BLOCKWISE_BACKWARD_BLOCK
        )
    # None: no cotangent for the segment ids, the offset, the cap and the derived inputs.
    d_inputs = AttentionInputs(prior=d_prior, ssmax_scale_H=d_scale, query_offset=None)
    return dq, dk, dv, d_inputs, None


def _fused_backward(config: KernelConfig, residuals, d_out):
    """The Triton backward; the per-head parameters' gradient is chained to the prior's
    fields and the SSMax scales by a VJP of `_head_param_columns`."""
    q, k, v, inputs, derived, out, lse = residuals
    # The kernels recompute the prior per element even where the forward read its table.
    config = dataclasses.replace(config, prior_table=False)

    def columns(prior, ssmax_scale_H):
        # Cast to vary with the rows, so that the VJP sums the gradient over batch shards.
        head_params = _head_param_columns(config, prior, ssmax_scale_H, q.shape[2])
        return vary_together(head_params, q, k, v)

    head_params, params_vjp = jax.vjp(columns, inputs.prior, inputs.ssmax_scale_H)
    rows = (
        kernel_operand(derived.log_n_BxT, jnp.float32),
        kernel_operand(inputs.query_segment_ids_BxT, jnp.int32),
        kernel_operand(inputs.key_segment_ids_BxS, jnp.int32),
    )
    backward = partitioned_by_batch_and_heads(
        functools.partial(_gpu_backward_shard, config),
        BACKWARD_OPERAND_ROLES,
        BACKWARD_RESULT_ROLES,
    )
    grads = backward(
        q, k, v, head_params, *rows, offset_operand(inputs.query_offset), out, lse, d_out
    )
    dq, dk, dv, d_head_params_BxHxP = vary_together(grads, q, k, v)  # as in `_forward`
    d_prior, d_scale = params_vjp(jnp.sum(d_head_params_BxHxP, axis=0))
    return dq, dk, dv, d_prior, d_scale


def _gpu_backward_shard(
    config: KernelConfig, q, k, v, head_params, log_n_BxT, q_seg_BxT, k_seg_BxS, offset_1, *rest
):
    """The Triton backward on one shard's arrays (BACKWARD_OPERAND_ROLES' order): dq, dk,
    dv and the head parameters' gradient by batch row [B, H, P], which the caller sums."""
    inputs = AttentionInputs(
        query_segment_ids_BxT=q_seg_BxT if config.segments else None,
        key_segment_ids_BxS=k_seg_BxS if config.segments else None,
        query_offset=offset_1[0],
    )
    derived = DerivedInputs(log_n_BxT if config.ssmax else None)
    return fused_gpu_backward(config, q, k, v, inputs, derived, head_params, *rest)


_attention.defvjp(_attention_fwd, _attention_bwd)
