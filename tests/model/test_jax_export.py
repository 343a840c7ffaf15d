"""Functions over bam_jax's pytrees export with jax.export, serialise, and reload in a fresh
process that has imported bam_jax; blockwise attention exports, the native CPU kernel is
refused at export time."""

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
