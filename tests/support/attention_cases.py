"""The attention cases of the attention, kernel and x64 tests: one `Case`, its inputs, and
checks of blockwise attention and of the kernels (the fused CPU kernel, Pallas in interpret
mode) against the reference oracle."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bam_jax.attention import dot_product_attention, reference_attention
from bam_jax.attention_spec import AttentionSpec
from bam_jax.fused_attention import fused_attention
from bam_jax.masking import AttentionMask, visibility_mask
from bam_jax.priors import AlibiPrior, GGDPrior, alibi_slopes

BETAS = (1.7, 1.0, 0.5, 0.0, -0.6)


@dataclasses.dataclass(frozen=True)
class Case:
    q_len: int
    kv_len: int | None = None  # None: q_len + offset
    offset: int = 0
    traced_offset: bool = False  # the offset a traced int32, as a decode loop passes it
    prior: str | None = "ggd"  # "ggd", "ggd_inference" (its inference form), "alibi" or None
    theta_mu: float = 0.0
    betas: tuple[float, ...] = BETAS
    documents: bool = False
    ssmax: bool = False
    prior_inside: bool = True
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 48
    block_q: int | None = 16
    block_k: int | None = 32
    causal: bool = True
    window: int | None = None
    batch: int = 2
    prior_table: bool = False
    ssmax_max_count: int | None = None

    @property
    def keys(self) -> int:
        return self.q_len + self.offset if self.kv_len is None else self.kv_len


def make_inputs(case: Case, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    b, t, s, d = case.batch, case.q_len, case.keys, case.head_dim
    inputs = {
        "q": jnp.asarray(rng.normal(size=(b, t, case.heads, d)), jnp.float32),
        "k": jnp.asarray(rng.normal(size=(b, s, case.kv_heads, d)), jnp.float32),
        "v": jnp.asarray(rng.normal(size=(b, s, case.kv_heads, d)), jnp.float32),
        "prior": None,
        "ssmax": None,
        "q_seg": None,
        "k_seg": None,
    }
    if case.prior in ("ggd", "ggd_inference"):
        betas = np.resize(np.asarray(case.betas, np.float32), case.heads)
        mus = np.full(case.heads, case.theta_mu, np.float32)
        mus[0] = 0.0
        inputs["prior"] = GGDPrior(
            theta_alpha_H=jnp.asarray(np.log(rng.uniform(0.05, 0.6, case.heads)), jnp.float32),
            theta_beta_H=jnp.asarray(betas),
            theta_mu_H=jnp.asarray(mus),
            form="inference" if case.prior == "ggd_inference" else "training",
        )
    elif case.prior == "alibi":
        inputs["prior"] = AlibiPrior(jnp.asarray(alibi_slopes(case.heads)))
    if case.ssmax:
        inputs["ssmax"] = jnp.asarray(rng.uniform(0.5, 1.5, case.heads), jnp.float32)
    if case.documents:
        k_seg = np.sort(rng.integers(0, 3, size=(b, s)), axis=1)
        k_seg[:, -min(3, max(1, s // 8)) :] = -1  # trailing padding
        if s >= 16:
            k_seg[0, s // 2] = -1  # a hole inside a document
        inputs["k_seg"] = jnp.asarray(k_seg, jnp.int32)
        inputs["q_seg"] = jnp.asarray(k_seg[:, case.offset : case.offset + t], jnp.int32)
    # Drawn last, so the other inputs do not depend on it.
    inputs["cotangent"] = jnp.asarray(rng.normal(size=(b, t, case.heads, d)), jnp.float32)
    return inputs


SPEC_FIELDS = frozenset(field.name for field in dataclasses.fields(AttentionSpec))


def attention_kwargs(case: Case, inputs: dict, **overrides) -> dict:
    """The case's `spec` and arrays by keyword; `overrides` replace either."""
    spec_fields = dict(
        causal=case.causal,
        window=case.window,
        ssmax_prior_inside=case.prior_inside,
        block_q=case.block_q,
        block_k=case.block_k,
    )
    arrays = dict(
        prior=inputs["prior"],
        ssmax_scale_H=inputs["ssmax"],
        ssmax_max_count=case.ssmax_max_count,
        query_segment_ids_BxT=inputs["q_seg"],
        key_segment_ids_BxS=inputs["k_seg"],
        query_offset=jnp.int32(case.offset) if case.traced_offset else case.offset,
    )
    for name, value in overrides.items():
        (spec_fields if name in SPEC_FIELDS else arrays)[name] = value
    return dict(spec=AttentionSpec(**spec_fields), **arrays)


def run_kernel(case: Case, backend: str, inputs: dict, **overrides) -> jax.Array:
    """The kernel on the case's inputs, jitted (op by op, interpret mode and the reference
    take several times longer); tests/kernels/test_cpu_kernel.py also runs it eagerly."""

    def run(inputs: dict) -> jax.Array:
        return fused_attention(
            inputs["q"],
            inputs["k"],
            inputs["v"],
            **attention_kwargs(case, inputs, **overrides),
            backend=backend,
            interpret=backend != "cpu",
            prior_table=case.prior_table,
        )

    return jax.jit(run)(inputs)


def run_reference(case: Case, inputs: dict, **overrides) -> jax.Array:
    def run(inputs: dict) -> jax.Array:
        return reference_attention(
            inputs["q"], inputs["k"], inputs["v"], **attention_kwargs(case, inputs, **overrides)
        )

    return jax.jit(run)(inputs)


def values_and_gradients(case: Case, inputs: dict, implementation: str) -> tuple:
    """`dot_product_attention`'s output and the gradients of sum(output * cotangent) with
    respect to q, k, v, the prior and the SSMax scales, from one jitted program."""

    def loss(q, k, v, prior, ssmax):
        kwargs = attention_kwargs(
            case, inputs, prior=prior, ssmax_scale_H=ssmax, implementation=implementation
        )
        out = dot_product_attention(q, k, v, **kwargs)
        return jnp.sum(out * inputs["cotangent"]), out

    grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
    (_, out), grads = grad_fn(
        inputs["q"], inputs["k"], inputs["v"], inputs["prior"], inputs["ssmax"]
    )
    return out, grads


def assert_close(actual, expected, rtol: float = 1e-5, name: str = "") -> None:
    """Within `rtol` of the largest |expected|, finite, of the same shape."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, name
    assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
    atol = rtol * max(float(np.max(np.abs(expected), initial=0.0)), 1e-6)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=name)


def check_against_reference(
    case: Case, implementation: str = "blockwise", rtol: float = 1e-5
) -> None:
    """`implementation`'s output and gradients equal the reference's on the case's inputs."""
    inputs = make_inputs(case)
    out_ref, grads_ref = values_and_gradients(case, inputs, "reference")
    out, grads = values_and_gradients(case, inputs, implementation)
    assert_close(out, out_ref, rtol, "output")
    names = ("dq", "dk", "dv", "dprior", "dssmax")
    for name, got, want in zip(names, grads, grads_ref, strict=True):
        leaves, leaves_ref = jax.tree.leaves(got), jax.tree.leaves(want)
        assert len(leaves) == len(leaves_ref), name
        for leaf, leaf_ref in zip(leaves, leaves_ref, strict=True):
            assert_close(leaf, leaf_ref, rtol, name)


def query_visible(case: Case, inputs: dict) -> np.ndarray:
    """[B, T, 1, 1] True for queries that see at least one key (others output zeros)."""
    mask = visibility_mask(
        AttentionMask(case.causal, case.window, case.keys),
        jnp.arange(case.q_len) + case.offset,
        jnp.arange(case.keys),
        inputs["q_seg"],
        inputs["k_seg"],
    )
    return np.asarray(mask.any(-1))[..., None, None]


def check_values(case: Case, backend: str, seed: int = 0) -> tuple[dict, jax.Array]:
    inputs = make_inputs(case, seed)
    out = run_kernel(case, backend, inputs)
    expected = run_reference(case, inputs)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)
    return inputs, out


def check_gradients(case: Case, backend: str, seed: int = 0) -> tuple[dict, tuple]:
    inputs = make_inputs(case, seed)
    mask = jnp.asarray(query_visible(case, inputs), jnp.float32)

    def loss(run, q, k, v, prior, ssmax):
        args = dict(inputs, q=q, k=k, v=v, prior=prior, ssmax=ssmax)
        return jnp.sum(run(args) * inputs["cotangent"] * mask)

    argnums = (0, 1, 2, 3, 4)
    primals = (inputs["q"], inputs["k"], inputs["v"], inputs["prior"], inputs["ssmax"])

    def gradients(run) -> tuple:
        return jax.jit(jax.grad(functools.partial(loss, run), argnums))(*primals)

    got = gradients(functools.partial(run_kernel, case, backend))
    want = gradients(functools.partial(run_reference, case))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        scale = max(1.0, float(jnp.max(jnp.abs(w))))
        np.testing.assert_allclose(g, w, atol=5e-5 * scale, rtol=1e-4)
    return inputs, got


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PowerLawPrior:
    """A prior the kernels know nothing about: -w_h * |d| ** 0.5."""

    weight_H: jax.Array

    @property
    def num_heads(self) -> int:
        return self.weight_H.shape[0]

    def bias(self, distance: jax.Array) -> jax.Array:
        weight = self.weight_H.reshape((-1,) + (1,) * jnp.ndim(distance))
        return -weight * jnp.sqrt(jnp.abs(distance))[None]


LOWERING_CASES = {
    "ggd_ssmax_documents_gqa": Case(
        q_len=1024, documents=True, ssmax=True, head_dim=64, block_q=None, block_k=None
    ),
    "alibi_outside_window_hd48_offset": Case(
        q_len=300,
        offset=77,
        prior="alibi",
        ssmax=True,
        prior_inside=False,
        window=128,
        block_q=None,
        block_k=None,
    ),
}


CPU_KERNEL_CASES = {
    "documents_ssmax_inside_gqa_hd48": Case(
        q_len=129, documents=True, ssmax=True, theta_mu=0.4, ssmax_max_count=50
    ),
    "long_prefill_two_tasks_many_key_tiles": Case(
        q_len=600, kv_len=900, offset=300, ssmax=True, heads=4, kv_heads=1, head_dim=32, batch=1
    ),
    "chunked_prefill_alibi_ssmax_outside": Case(
        q_len=7, offset=57, prior="alibi", ssmax=True, prior_inside=False
    ),
    "decode_single_query_hd16": Case(
        q_len=1, offset=300, kv_len=333, heads=5, kv_heads=1, head_dim=16
    ),
    "saturated_prior_documents_ssmax_outside": Case(
        q_len=150, betas=(-8.0, -30.0), documents=True, ssmax=True, prior_inside=False
    ),
    "window_documents": Case(q_len=300, window=37, ssmax=True, documents=True, head_dim=24),
    "bidirectional_window_alibi": Case(q_len=70, causal=False, window=9, prior="alibi"),
    "bidirectional_no_prior_wide_head": Case(
        q_len=90, kv_len=300, causal=False, prior=None, ssmax=True, head_dim=136, batch=1
    ),
    "no_prior_no_ssmax_hd8": Case(q_len=65, prior=None, head_dim=8, kv_heads=4),
    # A local layer over a long cache: the keys are cut to the window's 256-key tiles.
    "window_over_long_cache_gqa_ssmax": Case(
        q_len=300, kv_len=5000, offset=3001, window=16, ssmax=True, batch=1
    ),
    "window_over_long_cache_near_its_end": Case(
        q_len=70, kv_len=3000, offset=2925, window=40, ssmax=True, kv_heads=1, batch=1
    ),
}
