"""`dot_product_attention` rejects malformed inputs with an error naming the argument, and
every implementation agrees on empty inputs (length 0 queries or keys)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bam_jax
from bam_jax import blockwise
from bam_jax.attention import attend_reference, dot_product_attention, reference_attention
from bam_jax.attention_inputs import AttentionInputs
from bam_jax.attention_spec import AttentionSpec
from bam_jax.blockwise import attend_blockwise, blockwise_attention, flash_backward
from bam_jax.config import ModelConfig
from bam_jax.fused_attention import attend_fused, fused_attention
from bam_jax.model import Attention
from bam_jax.priors import GGDPrior, init_ggd_prior

IMPLEMENTATIONS = ("reference", "blockwise", "fused")
BATCH, HEADS, HEAD_DIM = 2, 2, 4


def _qkv(q_len: int = 8, kv_len: int = 8, heads: int = HEADS, kv_heads: int = HEADS):
    rng = np.random.default_rng(0)
    q_BxTxHxD = jnp.asarray(rng.normal(size=(BATCH, q_len, heads, HEAD_DIM)), jnp.float32)
    k_BxSxKxD = jnp.asarray(rng.normal(size=(BATCH, kv_len, kv_heads, HEAD_DIM)), jnp.float32)
    v_BxSxKxD = jnp.asarray(rng.normal(size=(BATCH, kv_len, kv_heads, HEAD_DIM)), jnp.float32)
    return q_BxTxHxD, k_BxSxKxD, v_BxSxKxD


def _attend(implementation: str, *args, **kwargs) -> jax.Array:
    return dot_product_attention(
        *args, implementation=implementation, block_q=4, block_k=4, **kwargs
    )


def _documents(length: int) -> jax.Array:
    """Three documents and a padded tail, the same for every row: int32 [B, length]."""
    row = np.minimum(np.arange(length) // 3, 2)
    row[-1] = -1
    return jnp.asarray(np.tile(row, (BATCH, 1)), jnp.int32)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_key_segment_ids_shaped_like_the_queries_are_rejected(implementation: str) -> None:
    """4 queries at offset 4 over 8 cached keys: the key ids must be [B, 8], not [B, 4].

    Blockwise used to clamp its key-id tiles into the short array and return wrong
    numbers (off by up to 3 from the reference here); the reference raised a raw
    broadcasting TypeError.
    """
    q, k, v = _qkv(q_len=4, kv_len=8)
    segments_BxS = _documents(8)
    with pytest.raises(ValueError, match=r"key_segment_ids_BxS .*\(2, 8\), got \(2, 4\)"):
        _attend(
            implementation,
            q,
            k,
            v,
            query_segment_ids_BxT=segments_BxS[:, 4:],
            key_segment_ids_BxS=segments_BxS[:, 4:],
            query_offset=4,
        )


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "name, shape",
    [("query_segment_ids_BxT", (1, 8)), ("key_segment_ids_BxS", (BATCH, 9)), ("both", (BATCH,))],
)
def test_segment_ids_of_the_wrong_shape_are_rejected(
    implementation: str, name: str, shape: tuple[int, ...]
) -> None:
    q, k, v = _qkv()
    good = _documents(8)
    bad = jnp.zeros(shape, jnp.int32)
    q_seg = good if name == "key_segment_ids_BxS" else bad
    k_seg = good if name == "query_segment_ids_BxT" else bad
    expected = "query_segment_ids_BxT" if name == "both" else name
    with pytest.raises(ValueError, match=rf"{expected} must have shape .*got \({shape[0]},"):
        _attend(implementation, q, k, v, query_segment_ids_BxT=q_seg, key_segment_ids_BxS=k_seg)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.uint32, jnp.bool_])
def test_segment_ids_must_be_signed_integers(implementation: str, dtype) -> None:
    q, k, v = _qkv()
    segments = _documents(8).astype(dtype)
    with pytest.raises(TypeError, match="query_segment_ids_BxT must have a signed integer dtype"):
        _attend(
            implementation, q, k, v, query_segment_ids_BxT=segments, key_segment_ids_BxS=segments
        )


def test_segment_ids_given_as_lists_are_accepted() -> None:
    q, k, v = _qkv()
    segments = _documents(8)
    for implementation in ("reference", "blockwise"):
        expected = _attend(
            implementation, q, k, v, query_segment_ids_BxT=segments, key_segment_ids_BxS=segments
        )
        as_lists = segments.tolist()
        out = _attend(
            implementation, q, k, v, query_segment_ids_BxT=as_lists, key_segment_ids_BxS=as_lists
        )
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("q_len, kv_len", [(0, 8), (8, 0), (0, 0)])
def test_length_zero_gives_a_zero_output_of_the_query_shape(
    implementation: str, q_len: int, kv_len: int
) -> None:
    """No query: an empty [B, 0, H, D]; no key: every query sees nothing, so zeros."""
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(q_len, kv_len))
    documents = {
        "query_segment_ids_BxT": jnp.zeros((BATCH, q_len), jnp.int32),
        "key_segment_ids_BxS": jnp.zeros((BATCH, kv_len), jnp.int32),
    }
    attend = functools.partial(
        _attend,
        implementation,
        prior=init_ggd_prior(HEADS, alpha_init="slope", beta_init=1.0),
        ssmax_scale_H=jnp.ones((HEADS,), jnp.float32),
        query_offset=kv_len - q_len if kv_len >= q_len else 0,
        **documents,
    )
    out = jax.jit(attend)(q, k, v)
    chex.assert_shape(out, (BATCH, q_len, HEADS, HEAD_DIM))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
    grads = jax.grad(lambda *xs: jnp.sum(attend(*xs).astype(jnp.float32)), (0, 1, 2))(q, k, v)
    for grad, x in zip(grads, (q, k, v), strict=True):
        assert grad.shape == x.shape
        np.testing.assert_array_equal(np.asarray(grad, np.float32), 0.0)


def test_reference_attention_called_directly_handles_length_zero() -> None:
    q, k, v = _qkv(q_len=5, kv_len=0)
    out = reference_attention(q, k, v, AttentionSpec())
    np.testing.assert_array_equal(out, np.zeros((BATCH, 5, HEADS, HEAD_DIM), np.float32))


def _uneven_prior() -> GGDPrior:
    """theta_beta has one value for two heads (it used to broadcast silently)."""
    prior = init_ggd_prior(HEADS)
    return prior.replace(theta_beta_H=prior.theta_beta_H[:1])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "make_inputs, kwargs, error, message",
    [
        (lambda: _qkv(heads=3), {}, ValueError, r"query heads \(3\) .* kv heads \(2\)"),
        (lambda: _qkv(kv_heads=0), {}, ValueError, r"query heads \(2\) .* kv heads \(0\)"),
        (_qkv, {"prior": init_ggd_prior(3)}, ValueError, r"prior.theta_alpha_H .*\(2,\).*\(3,\)"),
        (_qkv, {"prior": _uneven_prior()}, ValueError, r"prior.theta_beta_H .*\(2,\).*\(1,\)"),
        (_qkv, {"query_offset": 1.5}, TypeError, "query_offset must be an integer"),
        (_qkv, {"query_offset": jnp.arange(2)}, ValueError, r"query_offset .* shape \(2,\)"),
        (_qkv, {"query_offset": -1}, ValueError, "query_offset must be >= 0"),
        (_qkv, {"causal": "no"}, TypeError, "causal must be a bool"),
        (_qkv, {"window": True}, ValueError, "window must be None or an int"),
        (
            lambda: tuple(x.astype(jnp.int32) for x in _qkv()),
            {},
            TypeError,
            "query_BxTxHxD must have a floating-point dtype",
        ),
    ],
)
def test_bad_arguments_name_what_to_fix(
    implementation: str, make_inputs, kwargs: dict, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        _attend(implementation, *make_inputs(), **kwargs)


def test_the_nnx_attention_layer_gets_the_same_checks() -> None:
    config = ModelConfig.of_size("nano", encoding="bam", global_prior=False)
    attention = Attention(config.replace(attention_impl="blockwise"), rngs=nnx.Rngs(0))
    x_BxTxE = jnp.ones((BATCH, 6, config.dim), jnp.float32)
    with pytest.raises(TypeError, match="query_segment_ids_BxT must have a signed integer"):
        attention(x_BxTxE, jnp.zeros((BATCH, 6), jnp.float32))
    with pytest.raises(ValueError, match=r"query_segment_ids_BxT must have shape .*\(1, 6\)"):
        attention(x_BxTxE, jnp.zeros((1, 6), jnp.int32))


PER_CALL_ARRAYS = frozenset(f.name for f in dataclasses.fields(AttentionInputs))
IMPLEMENTATION_PARAMETERS = ["query_BxTxHxD", "key_BxSxKxD", "value_BxSxKxD", "spec", "inputs"]


def _documents_inputs(q_len: int = 8, kv_len: int = 8, offset=0) -> AttentionInputs:
    return AttentionInputs(
        prior=init_ggd_prior(HEADS),
        ssmax_scale_H=jnp.asarray([0.8, 1.3], jnp.float32),
        ssmax_max_count=5,
        query_segment_ids_BxT=_documents(kv_len)[:, kv_len - q_len :],
        key_segment_ids_BxS=_documents(kv_len),
        query_offset=offset,
    )


def test_the_per_call_arrays_are_one_pytree_exported_beside_the_spec() -> None:
    inputs = _documents_inputs(q_len=4, offset=jnp.int32(4))
    assert bam_jax.AttentionInputs is AttentionInputs
    leaves, treedef = jax.tree.flatten(inputs)
    # The prior's three fields, the scales, the cap, two segment arrays, the offset.
    assert len(leaves) == 8
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert rebuilt.query_offset is inputs.query_offset
    assert type(rebuilt.prior) is type(inputs.prior)
    assert all(a is b for a, b in zip(jax.tree.leaves(rebuilt), leaves, strict=True))
    assert inputs.has_documents and inputs.has_ssmax
    assert not AttentionInputs().has_documents and not AttentionInputs().has_ssmax


def test_the_inputs_check_themselves_and_name_the_field() -> None:
    q, k, v = _qkv()
    _documents_inputs().check(q, k, v)
    bad_scales = _documents_inputs().replace(ssmax_scale_H=jnp.ones((3,), jnp.float32))
    with pytest.raises(ValueError, match=r"ssmax_scale_H must have shape \(2,\)"):
        bad_scales.check(q, k, v)
    with pytest.raises(ValueError, match="ssmax_max_count caps SSMax's key count"):
        AttentionInputs(ssmax_max_count=4).check(q, k, v)
    with pytest.raises(ValueError, match="must be given together"):
        AttentionInputs(query_segment_ids_BxT=_documents(8)).check(q, k, v)


@pytest.mark.parametrize(
    "implementation, public",
    [
        (attend_reference, reference_attention),
        (attend_blockwise, blockwise_attention),
        (
            functools.partial(attend_fused, backend="cpu"),
            functools.partial(fused_attention, backend="cpu"),
        ),
    ],
)
def test_every_implementation_takes_query_key_value_spec_and_inputs(implementation, public) -> None:
    """The inputs pass through jit as one argument (the offset traced); the public keyword
    form computes the same, bit for bit."""
    q, k, v = _qkv(q_len=4, kv_len=8)
    spec = AttentionSpec(block_q=4, block_k=4)
    inputs = _documents_inputs(q_len=4, offset=jnp.int32(4))
    got = jax.jit(lambda inputs: implementation(q, k, v, spec, inputs))(inputs)
    keywords = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}
    want = jax.jit(lambda keywords: public(q, k, v, spec, **keywords))(keywords)
    np.testing.assert_array_equal(got, want)


def test_the_implementations_and_the_backward_share_one_signature() -> None:
    for function in (attend_reference, attend_blockwise, attend_fused, flash_backward):
        parameters = list(inspect.signature(function).parameters)
        assert parameters[:5] == IMPLEMENTATION_PARAMETERS, function.__name__
    public = inspect.signature(blockwise_attention).parameters
    assert {n for n, p in public.items() if p.kind == p.KEYWORD_ONLY} >= PER_CALL_ARRAYS


def test_no_function_spells_the_per_call_arrays_out_but_the_public_keyword_forms() -> None:
    """Functions of bam_jax taking three or more of the per-call arrays as parameters: only
    `dot_product_attention`, the keyword form `checked_attention` gives an implementation,
    and the mask's key count (masking.py lies below AttentionInputs, and its callers pass
    segment ids padded to whole tiles)."""
    spelled_out = []
    for path in sorted(pathlib.Path(bam_jax.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.Lambda):
                args = node.args
                names = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
                if len(names & PER_CALL_ARRAYS) >= 3:
                    spelled_out.append(f"{path.stem}.{getattr(node, 'name', 'lambda')}")
    assert sorted(spelled_out) == [
        "attention.dot_product_attention",
        "attention_inputs.run",
        "masking.visible_counts",
    ]


def test_blockwise_attention_reads_the_shared_prior_table(monkeypatch) -> None:
    """One table of distances for blockwise attention and the kernels
    (bam_jax/kernels/prior_table.py)."""
    calls = []

    def spy(*args):
        calls.append(args[:2])
        return prior_table_distances(*args)

    prior_table_distances = blockwise.prior_table_distances
    monkeypatch.setattr(blockwise, "prior_table_distances", spy)
    q, k, v = _qkv(q_len=6, kv_len=8)
    spec = AttentionSpec(block_q=4, block_k=4)
    out = blockwise_attention(q, k, v, spec, prior=init_ggd_prior(HEADS), query_offset=2)
    np.testing.assert_allclose(
        out,
        reference_attention(q, k, v, spec, prior=init_ggd_prior(HEADS), query_offset=2),
        atol=1e-6,
    )
    assert calls == [(8, 8)]  # queries padded to 8, keys 8
