"""Gradients of the SSMax scales and the GGD prior's parameters under sharp attention,
against a float64 oracle.

Logits 30 times the unit scale (queries drawn with standard deviation 30), SSMax's factor
log(n) of up to 7 on top and about 1,500 keys make attention nearly one-hot: the SSMax
gradient of a query, sum_j dS_ij x_ij, is then a small difference of terms as large as the
logits. Blockwise attention, the fused CPU kernel (its forward, the blockwise backward) and
the fused GPU kernels (forward and backward, in Pallas interpret mode) must keep these
gradients within GRAD_RTOL of float64, as the float32 reference does.

Float32 logits bound what any implementation can do. Here they reach 10^3 in log2 units,
where a float32 ulp is 6e-5, and the gradient of theta_mu of `prior_inside`'s second head
is a sum over queries of terms a hundred times its size: one rounding of every logit
(uniform, in float64) moves it by 2.5e-4 of its value (rms), 20 times as much as any other
gradient of these cases. The kernels' logits carry about 1.5 ulp (rms, where attention is
not negligible: the float32 dot product, the per-row coefficients, the GGD power computed
as exp2 of a rounded exponent), and their backwards differentiate those logits: the fused
GPU backward's error there, 1.6e-3, is that of the exact (float64) gradient of its own
logits, 1.3e-3, plus rounding of the log-sum-exp. So a gradient that misses GRAD_RTOL is
held instead to LOGIT_ULPS times its logit resolution (`logit_resolution`), when that is
larger.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bam_jax.attention import dot_product_attention
from bam_jax.attention_spec import AttentionSpec
from bam_jax.fused_attention import fused_attention
from bam_jax.priors import GGDPrior
from tests.support.cpu_compiler import needs_compiler
from tests.support.float64 import (
    float64_attention,
    float64_logits,
    float64_softmax_values,
    x64_mode,
)
from tests.support.grids import slow_unless

GRAD_RTOL = 1e-3
# A head whose gradient is below this fraction of the largest head's is held to that
# fraction instead: float32 logits cannot resolve it to 1e-3 of its own size.
GRAD_FLOOR = 0.1
VALUE_TOL = 2e-4
QKV_GRAD_TOL = 5e-4  # of the largest gradient entry
# Errors of the logits, in float32 ulps (rms), that a gradient's tolerance allows for when
# its logit resolution is coarser than GRAD_RTOL: about twice the GPU kernel's.
LOGIT_ULPS = 4.0


@dataclasses.dataclass(frozen=True)
class SharpCase:
    seed: int
    betas: tuple[float, ...]
    alphas: tuple[float, ...]
    theta_mus: tuple[float, ...]
    prior_inside: bool = True
    q_len: int = 1500  # not a multiple of any block
    kv_heads: int | None = None  # None: one per query head
    documents: bool = False
    head_dim: int = 32
    logit_scale: float = 30.0

    @property
    def heads(self) -> int:
        return len(self.betas)


CASES = {
    "prior_inside": SharpCase(seed=4, betas=(0.5, 0.8), alphas=(-2.0, -1.0), theta_mus=(0.1, 0.3)),
    "negative_shapes_inside": SharpCase(
        seed=5, betas=(-0.5, -1.5), alphas=(-1.0, 0.5), theta_mus=(0.2, 0.5)
    ),
    "negative_shapes_outside": SharpCase(
        seed=8, betas=(-0.5, -1.5), alphas=(-1.0, 0.5), theta_mus=(0.2, 0.5), prior_inside=False
    ),
    "documents_grouped_heads_inside": SharpCase(
        seed=6,
        betas=(0.7, 0.3, -0.4, 1.2),
        alphas=(-2.0, -1.0, -0.5, -3.0),
        theta_mus=(0.3, 0.4, 0.1, 0.2),
        q_len=1300,
        kv_heads=2,
        documents=True,
    ),
    "documents_grouped_heads_outside": SharpCase(
        seed=6,
        betas=(0.7, 0.3, -0.4, 1.2),
        alphas=(-2.0, -1.0, -0.5, -3.0),
        theta_mus=(0.3, 0.4, 0.1, 0.2),
        prior_inside=False,
        q_len=1300,
        kv_heads=2,
        documents=True,
    ),
}
# Shorter, for Pallas interpret mode; the fused GPU backward's SSMax gradient was 3e-3 to
# 9e-3 off float64 on both before it centred each query's sum.
# The cases the default suite runs (the rest are slow): documents with grouped-query heads
# and negative shapes with the prior outside SSMax.
DEFAULT_SUITE_CASES = ("documents_grouped_heads_inside", "negative_shapes_outside")
GPU_INTERPRET_CASES = {
    name: dataclasses.replace(CASES[name], q_len=1000)
    for name in ("prior_inside", "documents_grouped_heads_inside")
}
PRIMALS = ("q", "k", "v", "theta_alpha", "theta_beta", "theta_mu", "ssmax_scale")
IMPLEMENTATIONS = {
    "blockwise": functools.partial(dot_product_attention, implementation="blockwise"),
    "fused": functools.partial(dot_product_attention, implementation="fused"),
    "gpu_interpret": lambda q, k, v, *, ssmax_prior_inside, **arrays: fused_attention(
        q,
        k,
        v,
        AttentionSpec(ssmax_prior_inside=ssmax_prior_inside),
        **{"query_segment_ids_BxT": None, "key_segment_ids_BxS": None, **arrays},
        ssmax_max_count=None,
        query_offset=0,
        backend="gpu",
        interpret=True,
        backward="fused",
    ),
}


def make_inputs(case: SharpCase) -> tuple[dict[str, np.ndarray], np.ndarray | None, np.ndarray]:
    """float64 primals, document ids (or None) and the output's cotangent."""
    rng = np.random.default_rng(case.seed)
    kv_heads = case.kv_heads or case.heads
    shape_q = (1, case.q_len, case.heads, case.head_dim)
    shape_kv = (1, case.q_len, kv_heads, case.head_dim)
    primals = {
        "q": rng.normal(size=shape_q) * case.logit_scale,
        "k": rng.normal(size=shape_kv),
        "v": rng.normal(size=shape_kv),
    }
    cotangent = rng.normal(size=shape_q)
    primals |= {
        "theta_alpha": np.asarray(case.alphas),
        "theta_beta": np.asarray(case.betas),
        "theta_mu": np.asarray(case.theta_mus),
        "ssmax_scale": rng.uniform(0.8, 1.2, case.heads),
    }
    documents = None
    if case.documents:
        documents = np.sort(rng.integers(0, 3, size=(1, case.q_len)), axis=1)
    return primals, documents, cotangent


@functools.cache
def float64_values_and_gradients(case: SharpCase):
    """Computed once per case and process: the blockwise and fused checks share it."""
    primals, documents, cotangent = make_inputs(case)
    with x64_mode():

        def loss(*p):
            out = float64_attention(case.prior_inside, documents, *p)
            return jnp.sum(out * cotangent), out

        args = [jnp.asarray(primals[name], jnp.float64) for name in PRIMALS]
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=range(7), has_aux=True))(*args)
        return np.asarray(out), [np.asarray(g) for g in grads]


@functools.cache
def logit_resolution(case: SharpCase) -> list[np.ndarray]:
    """Per head parameter (PRIMALS[3:]) and head: the rms change of its float64 gradient when
    every visible logit moves by one float32 ulp (at its magnitude in log2 units, as the
    kernels hold them) with an independent sign, sqrt(sum_ij (dg/dL_ij ulp_ij)^2), with
    the logits' dependence on the parameters held fixed."""
    primals, documents, cotangent = make_inputs(case)
    count = len(PRIMALS[3:]) * case.heads
    with x64_mode():
        arrays = [jnp.asarray(primals[name], jnp.float64) for name in PRIMALS]
        docs = None if documents is None else jnp.asarray(documents)
        rms = jax.jit(functools.partial(_ulp_weighted_sensitivities, case.prior_inside, count))(
            docs, jnp.asarray(cotangent), *arrays
        )
    return list(np.reshape(np.asarray(rms), (len(PRIMALS[3:]), case.heads)))


def _ulp_weighted_sensitivities(
    prior_inside: bool, count: int, documents, cotangent, q, k, v, *params
) -> jax.Array:
    """sqrt(sum_ij (dg/dL_ij ulp_ij)^2) for each g of the `count` flattened head gradients;
    the logits, their VJP and their ulps are computed once for all of them."""

    def logits_of(*head_params):
        return float64_logits(prior_inside, documents, q, k, *head_params)

    logits, logits_vjp, visible = jax.vjp(logits_of, *params, has_aux=True)

    def head_gradients(logits_BxHxTxS):
        def loss(x):
            return jnp.sum(float64_softmax_values(x, visible, v) * cotangent)

        return jnp.concatenate([g.ravel() for g in logits_vjp(jax.grad(loss)(logits_BxHxTxS))])

    magnitude = jnp.abs(logits * np.log2(np.e)).astype(jnp.float32)
    ulp = jnp.where(visible, jnp.spacing(magnitude).astype(jnp.float64) * np.log(2), 0.0)

    def sensitivity(index):
        weighted = jax.grad(lambda x: head_gradients(x)[index])(logits) * ulp
        return jnp.sqrt(jnp.sum(weighted**2))

    return jax.lax.map(sensitivity, jnp.arange(count))


def float32_values_and_gradients(case: SharpCase, implementation: str):
    primals, documents, cotangent = make_inputs(case)
    segments = {}
    if documents is not None:
        ids = jnp.asarray(documents, jnp.int32)
        segments = {"query_segment_ids_BxT": ids, "key_segment_ids_BxS": ids}

    def run(q, k, v, alpha, beta, theta_mu, scale):
        return IMPLEMENTATIONS[implementation](
            q,
            k,
            v,
            prior=GGDPrior(alpha, beta, theta_mu),
            ssmax_scale_H=scale,
            ssmax_prior_inside=case.prior_inside,
            **segments,
        )

    def loss(*p):
        out = run(*p)
        return jnp.sum(out * jnp.asarray(cotangent, jnp.float32)), out

    args = [jnp.asarray(primals[name], jnp.float32) for name in PRIMALS]
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=range(7), has_aux=True))(*args)
    return np.asarray(out), [np.asarray(g) for g in grads]


def assert_head_gradients_close(
    case: SharpCase, index: int, got: np.ndarray, want: np.ndarray
) -> None:
    """PRIMALS[3 + index]'s gradient within GRAD_RTOL (of its size, or of GRAD_FLOOR of the
    largest head's), or within LOGIT_ULPS times its logit resolution, whichever is larger
    (the resolution is computed only for a gradient that misses the first)."""
    allowed = GRAD_RTOL * np.maximum(np.abs(want), GRAD_FLOOR * np.max(np.abs(want)))
    error = np.abs(got - want)
    if np.all(error <= allowed):
        return
    resolution = logit_resolution(case)[index]
    allowed = np.maximum(allowed, LOGIT_ULPS * resolution)
    assert np.all(error <= allowed), (
        f"{PRIMALS[3 + index]}: float32 {got}, float64 {want}, relative error "
        f"{error / np.abs(want)}, logit resolution {resolution}"
    )


def check_against_float64(case: SharpCase, implementation: str) -> None:
    want_out, want_grads = float64_values_and_gradients(case)
    out, grads = float32_values_and_gradients(case, implementation)
    np.testing.assert_allclose(out, want_out, atol=VALUE_TOL, rtol=VALUE_TOL)
    for index, (got, want) in enumerate(zip(grads[3:], want_grads[3:], strict=True)):
        assert_head_gradients_close(case, index, got, want)
    for name, got, want in zip(PRIMALS[:3], grads[:3], want_grads[:3], strict=True):
        np.testing.assert_allclose(
            got, want, atol=QKV_GRAD_TOL * np.max(np.abs(want)), err_msg=name
        )


@pytest.mark.parametrize("name", slow_unless(sorted(CASES), DEFAULT_SUITE_CASES))
def test_blockwise_gradients_match_float64(name: str) -> None:
    check_against_float64(CASES[name], "blockwise")


@needs_compiler
@pytest.mark.parametrize("name", slow_unless(sorted(CASES), DEFAULT_SUITE_CASES))
def test_fused_cpu_kernel_gradients_match_float64(name: str) -> None:
    check_against_float64(CASES[name], "fused")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GPU_INTERPRET_CASES))
def test_fused_gpu_backward_gradients_match_float64(name: str) -> None:
    check_against_float64(GPU_INTERPRET_CASES[name], "gpu_interpret")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_gpu_backward_gradients_match_float64_full_length(name: str) -> None:
    check_against_float64(CASES[name], "gpu_interpret")
