"""Attention and the Transformer under x64 mode (`jax_enable_x64`), float32 and float64 inputs.

Every implementation computes in float32 under x64 as well (docs/precision.md): float64
inputs are rounded to float32, the output and the gradients come back in the dtype of what
they belong to. So the expected numbers are those of the float32 reference outside x64 mode,
on the same (float32-rounded) inputs. x64 mode is switched on only inside `x64_mode`, so it
never leaks into other tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bam_jax.attention import dot_product_attention, reference_attention
from bam_jax.config import ModelConfig
from bam_jax.fused_attention import fused_attention
from bam_jax.model import Transformer
from tests.support.attention_cases import Case, attention_kwargs, make_inputs
from tests.support.cpu_compiler import HAS_COMPILER, needs_compiler
from tests.support.float64 import x64_mode
from tests.support.grids import slow_unless

ATOL = RTOL = 2e-5
GRAD_TOL = 1e-4

CASES = {
    # Documents with padding, SSMax inside with a capped count, theta_mu != 0,
    # grouped-query heads, a length off the blocks (and long enough for the CPU kernel).
    "documents_ssmax_inside": Case(
        q_len=70,
        documents=True,
        ssmax=True,
        theta_mu=0.4,
        ssmax_max_count=30,
        head_dim=16,
        block_q=16,
        block_k=16,
    ),
    # ALiBi after a query offset, SSMax outside.
    "alibi_offset_ssmax_outside": Case(
        q_len=67,
        offset=20,
        prior="alibi",
        ssmax=True,
        prior_inside=False,
        head_dim=16,
        block_q=16,
        block_k=16,
    ),
}
WINDOW_CASE = Case(q_len=40, window=17, ssmax=True, head_dim=16, block_q=16, block_k=16)
# The Pallas interpret paths are slow: one small case.
INTERPRET_CASE = dataclasses.replace(CASES["documents_ssmax_inside"], q_len=24, batch=1)


def numpy_inputs(case: Case) -> dict:
    """The case's inputs as numpy arrays, so that each mode builds its own jax arrays."""
    return jax.tree.map(np.asarray, make_inputs(case))


def as_jax(inputs: dict, dtype: jnp.dtype) -> dict:
    """Floating inputs in `dtype`, segment ids as jnp.asarray makes them (int64 under x64)."""

    def convert(x: np.ndarray) -> jax.Array:
        if np.issubdtype(x.dtype, np.floating):
            return jnp.asarray(x, dtype)
        return jnp.asarray(x.astype(np.int64))

    return jax.tree.map(convert, inputs)


def values_and_gradients(run: Callable[[dict], jax.Array], inputs: dict, cotangent: np.ndarray):
    """Output and the gradients of sum(output * cotangent) w.r.t. q, k, v, prior, scales."""

    def loss(q, k, v, prior, ssmax):
        out = run(dict(inputs, q=q, k=k, v=v, prior=prior, ssmax=ssmax))
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(cotangent, jnp.float32)), out

    primals = tuple(inputs[name] for name in ("q", "k", "v", "prior", "ssmax"))
    value_and_grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)
    (_, out), grads = jax.jit(value_and_grad)(*primals)
    return out, grads


def reference_run(case: Case) -> Callable[[dict], jax.Array]:
    def run(i: dict) -> jax.Array:
        return reference_attention(i["q"], i["k"], i["v"], **attention_kwargs(case, i))

    return run


def implementation_run(case: Case, implementation: str) -> Callable[[dict], jax.Array]:
    def run(i: dict) -> jax.Array:
        return dot_product_attention(
            i["q"],
            i["k"],
            i["v"],
            **attention_kwargs(
                case, i, query_offset=jnp.asarray(case.offset), implementation=implementation
            ),
        )

    return jax.jit(run)


def interpret_run(case: Case, backend: str, backward: str) -> Callable[[dict], jax.Array]:
    def run(i: dict) -> jax.Array:
        return fused_attention(
            i["q"],
            i["k"],
            i["v"],
            **attention_kwargs(case, i),
            backend=backend,
            interpret=True,
            backward=backward,
        )

    return run


def check_x64(case: Case, make_run: Callable[[], Callable[[dict], jax.Array]]) -> None:
    inputs = numpy_inputs(case)
    cotangent = np.random.default_rng(1).normal(size=inputs["q"].shape)
    want_out, want_grads = values_and_gradients(
        reference_run(case), as_jax(inputs, jnp.float32), cotangent
    )
    for dtype in (jnp.float32, jnp.float64):
        with x64_mode():
            x64_inputs = as_jax(inputs, dtype)
            out, grads = values_and_gradients(make_run(), x64_inputs, cotangent)
            assert out.dtype == dtype
            primals = [x64_inputs[name] for name in ("q", "k", "v", "prior", "ssmax")]
            for grad, primal in zip(jax.tree.leaves(grads), jax.tree.leaves(primals), strict=True):
                assert grad.dtype == primal.dtype
            out, grads = jax.tree.map(np.asarray, (out, grads))
        np.testing.assert_allclose(out, want_out, atol=ATOL, rtol=RTOL)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            scale = max(1.0, float(np.max(np.abs(want))))
            np.testing.assert_allclose(got, want, atol=GRAD_TOL * scale, rtol=GRAD_TOL)


@pytest.mark.parametrize(
    "name", slow_unless([*sorted(CASES), "window"], default=["documents_ssmax_inside"])
)
def test_blockwise_under_x64(name: str) -> None:
    case = CASES.get(name, WINDOW_CASE)
    check_x64(case, lambda: implementation_run(case, "blockwise"))


@needs_compiler
@pytest.mark.parametrize("name", slow_unless(sorted(CASES), default=["documents_ssmax_inside"]))
def test_fused_cpu_kernel_under_x64(name: str) -> None:
    # The native forward and the blockwise backward.
    check_x64(CASES[name], lambda: implementation_run(CASES[name], "fused"))


@pytest.mark.parametrize(
    ("backend", "backward"),
    [("gpu", "fused"), ("gpu", "blockwise"), ("tpu", "blockwise")],
)
@pytest.mark.slow
def test_pallas_interpret_under_x64(backend: str, backward: str) -> None:
    check_x64(INTERPRET_CASE, lambda: interpret_run(INTERPRET_CASE, backend, backward))


TOKENS = np.array([[3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3, 1, 4, 1, 5, 9, 2, 6, 5]])
SEGMENTS = np.array([[7] * 5 + [0] * 12 + [-1] * 3])


def model_loss_and_gradients(config: ModelConfig) -> tuple[np.ndarray, list[np.ndarray]]:
    model = Transformer(config, rngs=nnx.Rngs(3))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens, segments = jnp.asarray(TOKENS), jnp.asarray(SEGMENTS)

    @jax.jit
    def loss_and_gradients(params):
        def loss(params):
            logits = nnx.merge(graphdef, params, rest)(tokens, segments)[:, :-1]
            log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
            return -jnp.mean(jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1))

        return jax.value_and_grad(loss)(params)

    loss, grads = loss_and_gradients(params)
    return np.asarray(loss), [np.asarray(g) for g in jax.tree.leaves(grads)]


@pytest.mark.parametrize("implementation", ["blockwise", "fused"])
def test_transformer_forward_and_gradients_under_x64(implementation: str) -> None:
    if implementation == "fused" and not HAS_COMPILER:
        pytest.skip("the CPU kernel needs a C++ compiler")
    config = ModelConfig.of_size(
        "nano", encoding="bam_ssmax", attention_impl=implementation, max_seq_len=20
    )
    want_loss, want_grads = model_loss_and_gradients(config)
    with x64_mode():
        loss, grads = model_loss_and_gradients(config)
    assert loss.dtype == np.float32 and all(g.dtype == np.float32 for g in grads)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(grads, want_grads, strict=True):
        scale = max(1.0, float(np.max(np.abs(want))))
        np.testing.assert_allclose(got, want, atol=GRAD_TOL * scale, rtol=GRAD_TOL)
