"""Functions over bam_jax's pytrees export with jax.export, serialise, and reload in a fresh
process that has imported bam_jax; blockwise attention exports, with a symbolic batch and
length too (values and gradients), the native CPU kernel is refused at export time, and
the fused kernels with symbolic shapes say to export blockwise attention ("auto" does)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import bam_jax
from bam_jax import GGDPrior, KVCache, alibi_prior
from bam_jax.fused_attention import fused_attention
from bam_jax.kernels.cpu import TARGET_NAME
from tests.support.cpu_compiler import needs_compiler


def dilated_bias(prior, distance_D):
    dilated = prior.dilated(4.0)
    return dilated, dilated.bias(distance_D)


def test_a_function_of_priors_round_trips_through_serialisation():
    distance_D = -jnp.arange(6.0)
    for prior in (
        GGDPrior(jnp.full((2,), -0.5), jnp.array([0.5, 1.5]), jnp.zeros(2), form="inference"),
        alibi_prior(2),
    ):
        exported = export.export(jax.jit(dilated_bias))(prior, distance_D)
        reloaded = export.deserialize(exported.serialize())
        dilated, bias_HxD = reloaded.call(prior, distance_D)
        expected_prior, expected_bias = dilated_bias(prior, distance_D)
        assert type(dilated) is type(prior)
        np.testing.assert_array_equal(bias_HxD, expected_bias)
        assert jax.tree.structure(dilated) == jax.tree.structure(expected_prior)


def test_a_serialised_function_reloads_in_a_fresh_process(tmp_path):
    cache = KVCache(keys=(jnp.zeros((1, 4, 2, 8)),), values=(jnp.ones((1, 4, 2, 8)),), length=2)
    exported = export.export(jax.jit(lambda c: c.replace(length=c.length + 1)))(cache)
    path = tmp_path / "advance.bin"
    path.write_bytes(exported.serialize())
    script = textwrap.dedent(
        f"""
        import pathlib
        import jax.numpy as jnp
        from jax import export
        import bam_jax

        reloaded = export.deserialize(bytearray(pathlib.Path({str(path)!r}).read_bytes()))
        cache = bam_jax.KVCache(
            keys=(jnp.zeros((1, 4, 2, 8)),), values=(jnp.ones((1, 4, 2, 8)),), length=2
        )
        print(int(reloaded.call(cache).length))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "3"


@needs_compiler
def test_exporting_the_native_cpu_kernel_is_refused_and_blockwise_exports():
    q_BxTxHxD = jnp.ones((1, 128, 2, 8))

    def attention(implementation):
        return jax.jit(
            lambda q: bam_jax.dot_product_attention(q, q, q, implementation=implementation)
        )

    with pytest.raises(ValueError, match=f"(?s)custom calls.*{TARGET_NAME}"):
        export.export(attention("fused"))(q_BxTxHxD)
    exported = export.export(attention("blockwise"))(q_BxTxHxD)
    reloaded = export.deserialize(exported.serialize())
    np.testing.assert_array_equal(reloaded.call(q_BxTxHxD), attention("blockwise")(q_BxTxHxD))


def symbolic_arrays(*shapes: tuple[int | str, ...]) -> list[jax.ShapeDtypeStruct]:
    """Shapes with the symbolic batch "b" and length "t" of one scope: float32, int32 for a
    [b, t] of segment ids."""
    sizes = dict(zip("bt", export.symbolic_shape("b, t"), strict=True))
    return [
        jax.ShapeDtypeStruct(
            tuple(sizes.get(size, size) for size in shape),
            jnp.int32 if shape == ("b", "t") else jnp.float32,
        )
        for shape in shapes
    ]


def attention_loss(implementation: str, window: int | None):
    """Value and gradients (q, k, v, prior, SSMax scales) of a weighted sum of attention over
    documents, with grouped-query heads, SSMax and a prior with a negative shape."""

    def loss(q, k, v, prior, ssmax_scale_H, segments_BxT):
        out_BxTxHxD = bam_jax.dot_product_attention(
            q,
            k,
            v,
            prior=prior,
            ssmax_scale_H=ssmax_scale_H,
            query_segment_ids_BxT=segments_BxT,
            key_segment_ids_BxS=segments_BxT,
            implementation=implementation,
            window=window,
            block_q=64,
            block_k=64,
        )
        return jnp.sum(out_BxTxHxD * jnp.cos(q)), out_BxTxHxD

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


@pytest.mark.parametrize("window", [None, 7])
def test_blockwise_attention_exports_with_a_symbolic_batch_and_length(window):
    prior = GGDPrior(jnp.full((4,), -0.5), jnp.array([1.7, 1.0, 0.0, -0.6]), jnp.zeros(4))
    ssmax_H = jnp.array([0.5, 1.0, 1.5, 2.0])
    q, k, v, segments = symbolic_arrays(
        ("b", "t", 4, 16), ("b", "t", 2, 16), ("b", "t", 2, 16), ("b", "t")
    )
    exported = export.export(attention_loss("blockwise", window))(q, k, v, prior, ssmax_H, segments)
    reloaded = export.deserialize(exported.serialize())
    for batch, length in ((1, 5), (2, 150)):  # 150: three 64-query tiles, the last partial
        rng = np.random.default_rng(length)
        q = jnp.asarray(rng.normal(size=(batch, length, 4, 16)), jnp.float32)
        k, v = (jnp.asarray(rng.normal(size=(batch, length, 2, 16)), jnp.float32) for _ in "kv")
        segments_BxT = jnp.asarray(rng.integers(0, 3, (batch, length)).cumsum(1) // 40)
        args = (q, k, v, prior, ssmax_H, segments_BxT.astype(jnp.int32))
        (_, out), grads = reloaded.call(*args)
        (_, expected_out), expected_grads = attention_loss("reference", window)(*args)
        np.testing.assert_allclose(out, expected_out, atol=2e-5)
        pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True)
        for got, want in pairs:
            np.testing.assert_allclose(got, want, atol=2e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_a_pallas_kernel_with_symbolic_shapes_says_to_export_blockwise(backend):
    def attention(q_BxTxHxD):
        spec = bam_jax.AttentionSpec()
        return fused_attention(
            q_BxTxHxD, q_BxTxHxD, q_BxTxHxD, spec, backend=backend, interpret=True
        )

    (q_BxTxHxD,) = symbolic_arrays(("b", "t", 2, 16))
    with pytest.raises(ValueError, match=r"symbolic dimensions.*implementation='blockwise'"):
        export.export(jax.jit(attention))(q_BxTxHxD)
    auto = export.export(jax.jit(bam_jax.dot_product_attention))(q_BxTxHxD, q_BxTxHxD, q_BxTxHxD)
    assert [str(size) for size in auto.out_avals[0].shape] == ["b", "t", "2", "16"]
