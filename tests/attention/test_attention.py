"""Blockwise attention against the reference oracle, plus mask and prior properties."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bam_jax import attention_inputs, blockwise
from bam_jax.attention import dot_product_attention
from bam_jax.implementation import resolve_implementation
from bam_jax.masking import window_keys
from bam_jax.priors import AlibiPrior, GGDPrior, alibi_slopes, init_ggd_prior
from tests.support.attention_cases import (
    Case,
    assert_close,
    check_against_reference,
    make_inputs,
    values_and_gradients,
)
from tests.support.grids import slow_unless


def case_of(theta_beta: float | None = 1.0, **fields) -> Case:
    """This file's cases: 4 query and 4 key heads of 16 features, tiles of 64, and a GGD
    prior whose shape starts at `theta_beta` and grows by 0.1 a head (None: no prior)."""
    heads = fields.get("heads", 4)
    if theta_beta is None:
        prior = {"prior": None}
    else:
        prior = {"betas": tuple(round(theta_beta + 0.1 * h, 6) for h in range(heads))}
    defaults = dict(kv_heads=4, head_dim=16, block_q=64, block_k=64)
    return Case(**{**defaults, **prior, **fields})


# A covering subset of the grid: every length, block sizes that divide it and that do
# not, each sign of beta, both SSMax orders and every feature appear at least once.
DEFAULT_CASES = [
    case_of(q_len=1, block_q=16, block_k=16),
    case_of(q_len=7, block_q=4, block_k=2, theta_beta=-0.6, documents=True, ssmax=True),
    case_of(
        q_len=64,
        block_q=16,
        block_k=32,
        theta_beta=0.0,
        theta_mu=0.4,
        kv_heads=2,
        ssmax=True,
        prior_inside=False,
    ),
    case_of(q_len=129, block_q=128, block_k=16, theta_beta=1.7, theta_mu=-0.3, window=20),
    case_of(
        q_len=129, block_q=512, block_k=512, theta_beta=None, ssmax=True, kv_heads=1, causal=False
    ),
    case_of(
        q_len=64,
        kv_len=129,
        block_q=16,
        block_k=64,
        theta_beta=1.0,
        window=33,
        causal=False,
        ssmax=True,
    ),
    case_of(
        q_len=24,
        kv_len=129,
        offset=40,
        traced_offset=True,
        block_q=8,
        block_k=16,
        theta_beta=-0.6,
        documents=True,
        ssmax=True,
        prior_inside=False,
        kv_heads=2,
    ),
    case_of(
        q_len=1000,
        block_q=512,
        block_k=512,
        theta_beta=1.7,
        theta_mu=0.5,
        ssmax=True,
        prior_inside=False,
        kv_heads=2,
        window=300,
        batch=1,
    ),
    # An odd batch: the prior gradient's batch sum halves [5, ...] into 2 + 2 + 1 rows.
    case_of(q_len=50, block_q=16, block_k=16, theta_beta=0.7, ssmax=True, batch=5),
    # theta_beta near -8: the prior at d = mu saturates instead of overflowing to inf.
    case_of(q_len=70, block_q=16, block_k=32, theta_beta=-8.0, documents=True, ssmax=True),
    # SSMax's key count capped below the longest rows' counts.
    case_of(q_len=100, block_q=32, block_k=16, documents=True, ssmax=True, ssmax_max_count=30),
    # A zero window (each query sees itself) after an offset.
    case_of(q_len=33, kv_len=600, offset=300, block_q=16, block_k=32, window=0, ssmax=True),
    # A causal window over a long cache (a local layer), near the end of the cache where the
    # cut to the window's blocks cannot start at a block boundary.
    case_of(
        q_len=40,
        kv_len=1000,
        offset=955,
        traced_offset=True,
        block_q=16,
        block_k=64,
        theta_beta=1.0,
        window=20,
        documents=True,
        ssmax=True,
        batch=1,
    ),
]

# More combinations of the same features, run with the full grid.
SLOW_CASES = [
    case_of(
        q_len=50,
        kv_len=1000,
        offset=700,
        traced_offset=True,
        block_q=32,
        block_k=64,
        theta_beta=-0.6,
        window=20,
        ssmax=True,
        kv_heads=2,
        batch=1,
    ),
    case_of(q_len=7, block_q=16, block_k=16, theta_beta=1.7, ssmax=True),
    case_of(q_len=129, block_q=32, block_k=64, theta_beta=-0.6, documents=True, ssmax=True),
    case_of(q_len=24, kv_len=129, offset=70, block_q=16, block_k=32, theta_beta=0.5, ssmax=True),
    case_of(
        q_len=1000, block_q=256, block_k=128, theta_beta=0.5, documents=True, ssmax=True, batch=1
    ),
    case_of(
        q_len=64, kv_len=1000, offset=500, traced_offset=True, block_q=32, block_k=128, batch=1
    ),
    case_of(q_len=33, block_q=16, block_k=32, theta_beta=-0.6, documents=True, batch=3),
    case_of(
        q_len=70,
        block_q=32,
        block_k=16,
        theta_beta=-8.0,
        documents=True,
        ssmax=True,
        prior_inside=False,
    ),
    case_of(
        q_len=24,
        kv_len=129,
        offset=90,
        traced_offset=True,
        block_q=16,
        block_k=32,
        theta_beta=-0.6,
        ssmax=True,
        prior_inside=False,
        kv_heads=2,
        ssmax_max_count=64,
    ),
    case_of(q_len=30, kv_len=1000, offset=10, block_q=16, block_k=64, window=20, ssmax=True),
]


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=str)
def test_blockwise_matches_reference(case: Case) -> None:
    check_against_reference(case)


def test_window_keys_cut_whole_blocks_that_hold_the_window() -> None:
    slots = jnp.arange(1000, dtype=jnp.float32)[None, :, None, None]
    cut = functools.partial(window_keys, q_len=50, causal=True, window=20, block_k=64)
    keys, values, segments, offset = cut(slots, slots, None, jnp.int32(700))
    assert keys.shape[1] == 192 and segments is None
    start = 700 - int(offset)
    assert start == 640  # the block holding slot 680, the first query's oldest key
    np.testing.assert_array_equal(values[0, :, 0, 0], np.arange(start, start + 192))
    _, _, _, offset = cut(slots, slots, None, jnp.int32(955))
    assert 955 - int(offset) == 1000 - 192  # the cut stays inside the cache
    for kwargs in ({"window": None}, {"causal": False}, {"q_len": 950}):
        unchanged = window_keys(slots, slots, None, 5, **{**cut.keywords, **kwargs})
        assert unchanged[0] is slots and unchanged[3] == 5


@pytest.mark.parametrize("offset", slow_unless([0, 10, 700, 955], default=[955]))
def test_cutting_a_window_from_a_long_cache_changes_no_bit(monkeypatch, offset: int) -> None:
    case = case_of(
        q_len=45, kv_len=1000, offset=offset, block_q=16, block_k=64, window=20, ssmax=True
    )
    inputs = make_inputs(case)
    out_cut, grads_cut = values_and_gradients(case, inputs, "blockwise")
    monkeypatch.setattr(
        attention_inputs, "window_keys", lambda k, v, seg, off, **_: (k, v, seg, off)
    )
    out_whole, grads_whole = values_and_gradients(case, inputs, "blockwise")
    if offset != 955:  # there the cut starts between blocks: same function, other tiles
        np.testing.assert_array_equal(out_cut, out_whole)
    assert_close(out_cut, out_whole)
    for cut, whole in zip(jax.tree.leaves(grads_cut), jax.tree.leaves(grads_whole), strict=True):
        assert_close(cut, whole, 1e-5)


def _full_grid() -> list[Case]:
    cases = []
    lengths = (1, 7, 64, 129, 1000)
    blocks = (16, 64, 512)
    betas = (1.7, 1.0, 0.5, 0.0, -0.6)
    for length, block, beta, docs, (ssmax, inside) in itertools.product(
        lengths, blocks, betas, (False, True), ((False, True), (True, True), (True, False))
    ):
        cases.append(
            case_of(
                q_len=length,
                block_q=block,
                block_k=max(16, block // 4),
                theta_beta=beta,
                theta_mu=0.3,
                documents=docs,
                ssmax=ssmax,
                prior_inside=inside,
                kv_heads=2,
                batch=1,
            )
        )
    for offset, window in itertools.product((0, 100, 900), (None, 64)):
        cases.append(
            case_of(
                q_len=100, kv_len=1000, offset=offset, traced_offset=True, window=window, ssmax=True
            )
        )
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("case", _full_grid() + SLOW_CASES, ids=str)
def test_blockwise_matches_reference_full_grid(case: Case) -> None:
    check_against_reference(case)


def test_bfloat16_inputs_compute_in_float32() -> None:
    case = case_of(q_len=40, block_q=16, block_k=16, theta_beta=0.5, ssmax=True)
    inputs = make_inputs(case)
    q, k, v = (inputs[n].astype(jnp.bfloat16) for n in ("q", "k", "v"))

    def loss(q, k, v, implementation):
        out = dot_product_attention(
            q,
            k,
            v,
            prior=inputs["prior"],
            ssmax_scale_H=inputs["ssmax"],
            implementation=implementation,
            block_q=16,
            block_k=16,
        )
        return jnp.sum(out.astype(jnp.float32) * inputs["cotangent"]), out

    grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    (_, out_blk), grads_blk = grad_fn(q, k, v, "blockwise")
    (_, out_ref), grads_ref = grad_fn(q, k, v, "reference")
    assert out_blk.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(out_blk, np.float32), np.asarray(out_ref, np.float32), atol=2e-2
    )
    for g_blk, g_ref in zip(grads_blk, grads_ref, strict=True):
        assert g_blk.dtype == jnp.bfloat16
        scale = float(jnp.max(jnp.abs(g_ref.astype(jnp.float32))))
        np.testing.assert_allclose(
            np.asarray(g_blk, np.float32), np.asarray(g_ref, np.float32), atol=3e-2 * scale
        )


def test_queries_without_visible_keys_give_zero_output_and_gradient() -> None:
    case = case_of(q_len=20, block_q=8, block_k=8, documents=True, ssmax=True, batch=1)
    inputs = make_inputs(case)
    segments = jnp.asarray([[0] * 10 + [-1] * 10], jnp.int32)
    inputs["q_seg"] = inputs["k_seg"] = segments
    out, grads = values_and_gradients(case, inputs, "blockwise")
    padded = np.asarray(segments[0]) < 0
    assert np.all(np.asarray(out)[:, padded] == 0.0)
    for leaf in jax.tree.leaves(grads):
        assert np.all(np.isfinite(np.asarray(leaf)))
    assert np.all(np.asarray(grads[0])[:, padded] == 0.0)
    assert np.all(np.asarray(grads[1])[:, padded] == 0.0)


def _attend(q, k, v, prior, implementation="blockwise"):
    fn = functools.partial(
        dot_product_attention, implementation=implementation, block_q=32, block_k=16
    )
    return jax.jit(fn)(q, k, v, prior=prior)


def test_alibi_configured_ggd_equals_closed_form_alibi() -> None:
    case = case_of(q_len=60, heads=8, kv_heads=8, batch=1)
    inputs = make_inputs(case)
    slopes = alibi_slopes(8)
    ggd = init_ggd_prior(8, alpha_init="slope", beta_init=1.0)
    out_ggd = _attend(inputs["q"], inputs["k"], inputs["v"], ggd)
    out_alibi = _attend(inputs["q"], inputs["k"], inputs["v"], AlibiPrior(jnp.asarray(slopes)))
    assert_close(out_ggd, out_alibi, 1e-5)
    assert_close(
        out_alibi,
        _attend(inputs["q"], inputs["k"], inputs["v"], AlibiPrior(slopes), "reference"),
        1e-5,
    )


def test_uniform_init_equals_no_prior() -> None:
    case = case_of(q_len=60, batch=1)
    inputs = make_inputs(case)
    uniform = init_ggd_prior(4, alpha_init=1.0, beta_init=0.0)
    out_uniform = _attend(inputs["q"], inputs["k"], inputs["v"], uniform)
    out_nope = _attend(inputs["q"], inputs["k"], inputs["v"], None)
    assert_close(out_uniform, out_nope, 1e-5)


def _input_jacobian(segments: jax.Array | None, length: int = 20) -> np.ndarray:
    """|d out[i] / d x[j]| summed over features, for q, k and v all derived from x."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(1, length, 2, 4)), jnp.float32)
    prior = GGDPrior(*(jnp.asarray(rng.normal(size=2), jnp.float32) for _ in range(3)))
    scale = jnp.ones((2,), jnp.float32)

    def attend(x_BxTxHxD):
        return dot_product_attention(
            x_BxTxHxD,
            x_BxTxHxD * 0.5,
            x_BxTxHxD * 2.0,
            prior=prior,
            ssmax_scale_H=scale,
            query_segment_ids_BxT=segments,
            key_segment_ids_BxS=segments,
            implementation="blockwise",
            block_q=8,
            block_k=8,
        )

    jac = jax.jit(jax.jacrev(attend))(x)[0, :, :, :, 0]  # [T, H, D, S, K, D]
    return np.abs(np.asarray(jac)).sum(axis=(1, 2, 4, 5))


def test_causality_by_gradient() -> None:
    jac_TxS = _input_jacobian(None)
    assert np.all(np.triu(jac_TxS, k=1) == 0.0)
    assert np.all(np.diag(jac_TxS) > 0.0)


def test_documents_are_isolated_by_gradient() -> None:
    segments = jnp.asarray([[0] * 7 + [1] * 9 + [-1] * 4], jnp.int32)
    jac_TxS = _input_jacobian(segments)
    seg = np.asarray(segments[0])
    across = seg[:, None] != seg[None, :]
    assert np.all(jac_TxS[across] == 0.0)
    same = (seg[:, None] == seg[None, :]) & (seg[:, None] >= 0)
    assert np.all(jac_TxS[same & np.tri(len(seg), dtype=bool)] > 0.0)


class JitVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_and_eager_agree(self) -> None:
        case = case_of(q_len=20, kv_len=40, offset=20, block_q=8, block_k=8, documents=True)
        inputs = make_inputs(case)

        def fn(q, k, v, prior, scale, q_seg, k_seg):
            return dot_product_attention(
                q,
                k,
                v,
                prior=prior,
                ssmax_scale_H=scale,
                query_segment_ids_BxT=q_seg,
                key_segment_ids_BxS=k_seg,
                query_offset=20,
                implementation="blockwise",
                block_q=8,
                block_k=8,
            )

        scale = jnp.full((4,), 1.3, jnp.float32)
        args = (inputs[n] for n in ("q", "k", "v", "prior"))
        out = self.variant(fn)(*args, scale, inputs["q_seg"], inputs["k_seg"])
        expected = jax.jit(fn)(
            *(inputs[n] for n in ("q", "k", "v", "prior")), scale, inputs["q_seg"], inputs["k_seg"]
        )
        assert_close(out, expected, 1e-5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_q": 0}, "block_q"),
        ({"block_k": -4}, "block_k"),
        ({"window": -1}, "window"),
    ],
)
def test_blockwise_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    x = jnp.zeros((1, 8, 2, 4), jnp.float32)
    with pytest.raises(ValueError, match=message):
        dot_product_attention(x, x, x, implementation="blockwise", **kwargs)


def test_the_default_implementation_is_the_scalable_one_and_matches_the_reference():
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 70, 4, 8)), jnp.float32) for _ in range(3))
    prior = GGDPrior(
        jnp.asarray([0.5, 1.0, -0.3, 2.0]), jnp.asarray([0.1, -0.4, 0.6, 1.5]), jnp.zeros(4)
    )
    kwargs = dict(prior=prior, ssmax_scale_H=jnp.full((4,), 0.7), block_q=32, block_k=32)
    assert resolve_implementation() == "blockwise"

    def attend(**implementation):
        attention = functools.partial(dot_product_attention, **kwargs, **implementation)
        return jax.jit(attention)(q, k, v)

    chosen = attend()
    blockwise = attend(implementation="blockwise")
    reference = attend(implementation="reference")
    np.testing.assert_array_equal(chosen, blockwise)
    np.testing.assert_allclose(chosen, reference, atol=2e-5)


def test_steep_prior_with_ssmax_far_behind_the_cache_stays_finite() -> None:
    # Priors a quick-start model learned: a steep head (beta 3.1) whose bias reaches -7e9 at
    # 8k tokens, scaled by SSMax, for a prefill chunk 7680 tokens into the cache.
    prior = GGDPrior(
        jnp.log(jnp.array([14.666, 0.131, 0.011, 0.004], jnp.float32)),
        jnp.array([-0.602, 2.395, -0.128, 3.099], jnp.float32),
        jnp.zeros((4,), jnp.float32),
    )
    scale = jnp.array([0.307, 0.26, 0.251, 0.083], jnp.float32)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, 512, 4, 16))
    k, v = (jax.random.normal(key, (1, 8192, 4, 16)) for key in keys[1:])
    outs = [
        jax.jit(
            functools.partial(
                dot_product_attention,
                prior=prior,
                ssmax_scale_H=scale,
                implementation=impl,
                block_q=256,
                block_k=256,
            )
        )(q, k, v, query_offset=jnp.int32(7680))
        for impl in ("reference", "blockwise")
    ]
    assert_close(outs[1], outs[0], 1e-5, "output")


def test_capped_ssmax_count_scales_by_the_log_of_the_cap() -> None:
    """The reference against a numpy softmax of (q.k / sqrt(D) + bias) * s * log(min(n, cap))."""
    case = case_of(q_len=40, heads=2, kv_heads=2, batch=1, ssmax=True, theta_beta=0.5)
    inputs, cap = make_inputs(case), 9
    capped = dataclasses.replace(case, ssmax_max_count=cap)
    out, _ = values_and_gradients(capped, inputs, "reference")
    q, k, v = (np.asarray(inputs[name], np.float64) for name in "qkv")
    distance = np.arange(case.q_len)[None, :] - np.arange(case.q_len)[:, None]
    bias = np.asarray(inputs["prior"].bias(jnp.asarray(distance)), np.float64)
    count = np.minimum(np.arange(1, case.q_len + 1), cap)
    factor = np.asarray(inputs["ssmax"], np.float64)[:, None] * np.log(count)[None, :]
    content = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(case.head_dim)
    logits = (content + bias) * factor[..., None]
    logits = np.where(distance <= 0, logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    np.testing.assert_allclose(out, np.einsum("bhts,bshd->bthd", weights, v), rtol=2e-5, atol=2e-6)


def test_a_cap_at_or_above_every_count_changes_nothing() -> None:
    case = case_of(q_len=70, block_q=16, block_k=32, documents=True, ssmax=True, kv_heads=2)
    inputs = make_inputs(case)
    for implementation in ("reference", "blockwise"):
        plain, plain_grads = values_and_gradients(case, inputs, implementation)
        capped, capped_grads = values_and_gradients(
            dataclasses.replace(case, ssmax_max_count=70), inputs, implementation
        )
        np.testing.assert_array_equal(capped, plain)
        for a, b in zip(jax.tree.leaves(capped_grads), jax.tree.leaves(plain_grads), strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(ssmax_max_count=8), ValueError, "needs ssmax_scale_H"),
        (dict(ssmax_max_count=0, ssmax_scale_H=jnp.ones(4)), ValueError, ">= 1"),
        (dict(ssmax_max_count=2.5, ssmax_scale_H=jnp.ones(4)), TypeError, "integer scalar"),
    ],
)
def test_bad_ssmax_max_count_raises(kwargs: dict, error: type, message: str) -> None:
    x = jnp.zeros((1, 8, 4, 16))
    with pytest.raises(error, match=message):
        dot_product_attention(x, x, x, implementation="blockwise", **kwargs)


@pytest.mark.parametrize(
    "rows, cols",
    slow_unless([(1, 1), (1, 5), (5, 1), (3, 7), (64, 64), (150, 37)], default=[(1, 5), (150, 37)]),
)
def test_diagonal_sums_add_each_diagonal_of_the_tile(rows, cols):
    x_HxMxN = np.random.default_rng(rows * cols).normal(size=(2, rows, cols)).astype(np.float32)
    expected_HxX = np.zeros((2, rows + cols - 1))
    for i, j in itertools.product(range(rows), range(cols)):
        expected_HxX[:, j - i + rows - 1] += x_HxMxN[:, i, j]
    np.testing.assert_allclose(
        blockwise._diagonal_sums(jnp.asarray(x_HxMxN)), expected_HxX, rtol=1e-5, atol=1e-5
    )
