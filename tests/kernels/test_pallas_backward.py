"""The fused GPU backward (Triton semantics, interpret mode on CPU) against the blockwise
backward (`backward="blockwise"`) and the reference attention's autodiff.

Tolerances, per gradient (dq, dk, dv, every prior field, the SSMax scales), with
scale = max(1, max |expected|):
- float32: max |fused - blockwise| <= 2e-5 * scale (both recompute the probabilities from
  the same log-sum-exp; observed <= 8e-6), and fused against the reference's autodiff as
  tests/kernels/test_pallas_attention.py's `check_gradients` (atol 5e-5 * scale, rtol 1e-4),
  which with backend="gpu" runs the fused backward too (its saturated-prior test among
  them; the slow grid below checks saturated priors against the blockwise backward);
- bfloat16 inputs: max |fused - blockwise| <= 2e-2 * scale (the fused kernels multiply
  bfloat16 probabilities and softmax gradients, as the forward does its probabilities).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bam_jax.fused_attention import fused_attention
from bam_jax.kernels.lowering import lower_for
from tests.support.attention_cases import (
    LOWERING_CASES,
    Case,
    PowerLawPrior,
    attention_kwargs,
    make_inputs,
    query_visible,
    run_reference,
)

FLOAT32_VS_BLOCKWISE = 2e-5
BFLOAT16_VS_BLOCKWISE = 2e-2


def gradients(case: Case, inputs: dict, backward: str | None) -> tuple:
    """Gradients of a masked weighted sum of the output with respect to (q, k, v, prior,
    ssmax): of the kernel with the given backward, or of the reference for None."""
    cotangent = jnp.asarray(np.random.default_rng(1).normal(size=inputs["q"].shape), jnp.float32)
    weights = cotangent * jnp.asarray(query_visible(case, inputs), jnp.float32)

    def loss(q, k, v, prior, ssmax):
        args = dict(inputs, q=q, k=k, v=v, prior=prior, ssmax=ssmax)
        if backward is None:
            out = run_reference(case, args)
        else:
            out = fused_attention(
                q,
                k,
                v,
                **attention_kwargs(case, args),
                backend="gpu",
                interpret=True,
                backward=backward,
                prior_table=case.prior_table,
            )
        return jnp.sum(out.astype(jnp.float32) * weights)

    primals = (inputs["q"], inputs["k"], inputs["v"], inputs["prior"], inputs["ssmax"])
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*primals)


def named_leaves(grads: tuple) -> list[tuple[str, np.ndarray]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(grads)
    names = ("dq", "dk", "dv", "d_prior", "d_ssmax")
    return [
        (names[path[0].idx] + jax.tree_util.keystr(path[1:]), np.asarray(x, np.float64))
        for path, x in flat
    ]


def assert_close(got: tuple, want: tuple, *, atol: float, rtol: float = 0.0) -> float:
    """Checks every gradient (atol scaled by max(1, max |want|)); the largest scaled error."""
    got_leaves, want_leaves = named_leaves(got), named_leaves(want)
    assert [n for n, _ in got_leaves] == [n for n, _ in want_leaves]
    worst = 0.0
    for (name, g), (_, w) in zip(got_leaves, want_leaves, strict=True):
        assert g.shape == w.shape, name
        assert np.all(np.isfinite(g)), name
        scale = max(1.0, float(np.max(np.abs(w), initial=0.0)))
        np.testing.assert_allclose(g, w, atol=atol * scale, rtol=rtol, err_msg=name)
        worst = max(worst, float(np.max(np.abs(g - w), initial=0.0)) / scale)
    return worst


def check_fused_backward(case: Case, seed: int = 0) -> tuple[dict, tuple]:
    inputs = make_inputs(case, seed)
    fused = gradients(case, inputs, "fused")
    assert_close(fused, gradients(case, inputs, "blockwise"), atol=FLOAT32_VS_BLOCKWISE)
    assert_close(fused, gradients(case, inputs, None), atol=5e-5, rtol=1e-4)
    return inputs, fused


# ---------------------------------------------------------------------------------------
# Default suite.


@pytest.mark.slow
def test_fused_backward_matches_blockwise_and_reference() -> None:
    # Several full (unmasked) key blocks below the diagonal, theta_mu != 0, SSMax inside.
    check_fused_backward(Case(q_len=70, ssmax=True, theta_mu=0.5))


@pytest.mark.slow
def test_fused_backward_with_documents_matches_blockwise() -> None:
    # Documents with padding and a hole, a query offset, SSMax outside, one kv head,
    # block_q > block_k, lengths not a block multiple. (The gradient tests of
    # tests/kernels/test_pallas_attention.py run the fused backward against the reference with
    # documents, so the default suite spends no third run on it here.)
    case = Case(
        q_len=33,
        offset=12,
        documents=True,
        ssmax=True,
        prior_inside=False,
        kv_heads=1,
        block_q=32,
        block_k=16,
    )
    inputs = make_inputs(case)
    fused = gradients(case, inputs, "fused")
    assert_close(fused, gradients(case, inputs, "blockwise"), atol=FLOAT32_VS_BLOCKWISE)
    k_padding = np.asarray(inputs["k_seg"]) < 0
    assert k_padding.any()
    for grad in fused[1:3]:
        np.testing.assert_array_equal(np.asarray(grad)[k_padding], 0.0)


@pytest.mark.slow
def test_fused_backward_bfloat16_inputs() -> None:
    # ALiBi, multi-head (kv_heads = heads), SSMax inside.
    case = Case(q_len=20, offset=5, prior="alibi", ssmax=True, kv_heads=4)
    inputs = make_inputs(case)
    inputs = {**inputs, **{name: inputs[name].astype(jnp.bfloat16) for name in ("q", "k", "v")}}
    fused = gradients(case, inputs, "fused")
    for grad in fused[:3]:
        assert grad.dtype == jnp.bfloat16
    assert_close(fused, gradients(case, inputs, "blockwise"), atol=BFLOAT16_VS_BLOCKWISE)


@pytest.mark.slow
def test_fused_backward_after_a_table_forward() -> None:
    # The forward reads the prior from its table; the backward recomputes it per element.
    check_fused_backward(Case(q_len=40, ssmax=True, theta_mu=0.4, prior_table=True, batch=1))


def test_backward_argument_is_checked() -> None:
    case = Case(q_len=8)
    inputs = make_inputs(case)
    args = (inputs["q"], inputs["k"], inputs["v"])
    kwargs = attention_kwargs(case, inputs)
    with pytest.raises(ValueError, match="backward"):
        fused_attention(*args, **kwargs, backend="gpu", interpret=True, backward="triton")
    with pytest.raises(NotImplementedError, match=r"backward='fused'.*gpu"):
        fused_attention(*args, **kwargs, backend="tpu", interpret=True, backward="fused")
    kwargs["prior"] = PowerLawPrior(jnp.ones((4,), jnp.float32))
    with pytest.raises(NotImplementedError, match=r"GGDPrior \(training form\) and AlibiPrior"):
        fused_attention(*args, **kwargs, backend="gpu", interpret=True, backward="fused")


@pytest.mark.parametrize("name", sorted(LOWERING_CASES))
def test_backward_kernels_lower_for_cuda(name: str) -> None:
    case = LOWERING_CASES[name]
    inputs = jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 and x.ndim == 4 else x,
        make_inputs(case),
    )

    def loss(q, k, v, prior, ssmax):
        arrays = dict(inputs, prior=prior, ssmax=ssmax)
        kwargs = attention_kwargs(case, arrays, block_q=None, block_k=None)
        out = fused_attention(q, k, v, **kwargs, backend="gpu")  # default backward: fused
        return jnp.sum(out.astype(jnp.float32))

    args = (inputs["q"], inputs["k"], inputs["v"], inputs["prior"], inputs["ssmax"])
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    text = lower_for(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), shapes, "cuda").as_text()
    assert text.count("xla.gpu.triton") == 3  # the forward, dK/dV and dQ kernels
    for kernel in ("bam_attention_fwd", "bam_attention_dkdv", "bam_attention_dq"):
        assert kernel in text


# ---------------------------------------------------------------------------------------
# Fuller grid: pytest -m slow tests/kernels/test_pallas_backward.py

SLOW_CASES = [
    Case(q_len=100, ssmax=True, theta_mu=0.5),
    Case(q_len=45, documents=True, ssmax=True, prior_inside=False, kv_heads=1, block_q=32),
    Case(q_len=20, offset=37, prior="alibi", ssmax=True, kv_heads=4),
    Case(q_len=129, documents=True, ssmax=True, theta_mu=0.5, block_q=32, block_k=16),
    Case(q_len=129, ssmax=True, prior_inside=False, kv_heads=1),
    Case(q_len=64, offset=65, prior="alibi", ssmax=True, documents=True),
    Case(q_len=64, offset=65, prior="alibi", ssmax=True, prior_inside=False, kv_heads=1),
    Case(q_len=64, prior=None, ssmax=True, head_dim=64, kv_heads=4),
    Case(q_len=33, prior=None, documents=True, block_q=32, block_k=16),
    Case(q_len=50, window=17, ssmax=True, documents=True),
    Case(q_len=40, causal=False, window=9, documents=True, ssmax=True, block_q=32, block_k=16),
    Case(q_len=33, causal=False, ssmax=True, prior="alibi"),
    Case(q_len=1, offset=40, ssmax=True),
    Case(q_len=1, offset=63, kv_len=80, heads=5, kv_heads=1),
    Case(q_len=7, offset=33, theta_mu=0.7, ssmax=True, documents=True, block_q=16, block_k=16),
    Case(q_len=40, betas=(-8.0, -30.0), documents=True, ssmax=True, prior_inside=False),
    Case(q_len=40, betas=(-8.0, -30.0), ssmax=True, theta_mu=0.4, kv_heads=1),
    Case(q_len=100, offset=13, window=21, ssmax=True, documents=True, block_q=64, block_k=16),
    Case(q_len=64, theta_mu=-0.5, batch=3, block_q=16, block_k=64),
    Case(q_len=129, documents=True, ssmax=True, prior_inside=False, prior_table=True),
    Case(q_len=64, offset=65, prior="alibi", ssmax=True, prior_table=True),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=str)
def test_fused_backward_full_grid(case: Case) -> None:
    check_fused_backward(case)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        Case(q_len=40, ssmax=True, theta_mu=0.3, block_q=32, block_k=16),
        Case(q_len=64, prior=None, documents=True, kv_heads=1),
        Case(q_len=70, offset=20, prior="alibi", ssmax=True, prior_inside=False, block_q=32),
    ],
    ids=str,
)
def test_fused_backward_bfloat16_full_grid(case: Case) -> None:
    inputs = make_inputs(case)
    inputs = {**inputs, **{name: inputs[name].astype(jnp.bfloat16) for name in ("q", "k", "v")}}
    fused = gradients(case, inputs, "fused")
    assert_close(fused, gradients(case, inputs, "blockwise"), atol=BFLOAT16_VS_BLOCKWISE)
