"""Attention under jit on arrays sharded by NamedSharding, as a user's model shards them: q, k
and v split by batch and heads over a 2 x 2 mesh (grouped-query heads, documents, SSMax, a
GGD prior with a negative shape, a length that is no multiple of the tiles), for blockwise
attention, the native CPU kernel and the Pallas GPU kernel (interpret mode, with its Triton
backward). The compiled
forward holds no collective and returns the output sharded like q; the compiled gradient's
only collectives are the all-reduces that sum the prior's and the SSMax scales' gradients
over the batch shards, and dq, dk, dv come back sharded like q, k, v. Values and gradients
match the unsharded reference. Run in a subprocess on 4 fake CPU devices (the device count
is fixed when jax starts)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.support.cpu_compiler import HAS_COMPILER
from tests.support.grids import selected_values
from tests.support.host_devices import host_devices_result

CHECK = """
import json, re, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import bam_jax
from bam_jax.fused_attention import fused_attention
from bam_jax.priors import GGDPrior

# The Pallas GPU kernel in interpret mode, forward and Triton backward (the TPU kernel's
# interpret mode runs callbacks, which a partitioning rule cannot hold).
PALLAS = {"gpu_interpret": ("gpu", "fused")}

mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
B, T, H, K, D = 4, 150, 4, 2, 8
rng = np.random.default_rng(0)
HEADS = NamedSharding(mesh, P("data", None, "model", None))
ROWS = NamedSharding(mesh, P("data", None))
q = jax.device_put(jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32), HEADS)
k, v = (
    jax.device_put(jnp.asarray(rng.normal(size=(B, T, K, D)), jnp.float32), HEADS) for _ in "kv"
)
segments = jax.device_put(
    jnp.asarray(np.minimum(np.arange(T) // 61, 2)[None].repeat(B, 0), jnp.int32), ROWS
)
prior = GGDPrior(
    theta_alpha_H=jnp.log(jnp.asarray([0.1, 0.2, 0.3, 0.5])),
    theta_beta_H=jnp.asarray([-0.6, 0.4, 1.0, 1.7]),
    theta_mu_H=jnp.zeros(H),
)
ssmax = jnp.asarray(rng.uniform(0.5, 1.5, H), jnp.float32)
weights = jax.device_put(jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32), HEADS)
KINDS = "all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter"
COLLECTIVE = re.compile(r"= (\\S[^=]*?) (" + KINDS + ")(?:-start)?\\(")


def attention(implementation, q, k, v, prior, ssmax):
    arrays = dict(
        prior=prior, ssmax_scale_H=ssmax, ssmax_max_count=None, query_offset=0,
        query_segment_ids_BxT=segments, key_segment_ids_BxS=segments,
    )
    if implementation in PALLAS:
        backend, backward = PALLAS[implementation]
        spec = bam_jax.AttentionSpec(block_q=32, block_k=32)
        return fused_attention(
            q, k, v, spec, **arrays, backend=backend, interpret=True, backward=backward
        )
    spec = bam_jax.AttentionSpec(implementation=implementation, block_q=64, block_k=64)
    return bam_jax.dot_product_attention(q, k, v, spec, **arrays)


def loss(implementation):
    return lambda *args: jnp.sum(attention(implementation, *args) * weights)


def collectives(compiled):
    return [(kind, shape) for shape, kind in COLLECTIVE.findall(compiled.as_text())]


def relative_error(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def compiled(implementation):
    forward = jax.jit(lambda *a: attention(implementation, *a)).lower(*ARGS).compile()
    gradient = jax.jit(jax.grad(loss(implementation), argnums=(0, 1, 2, 3, 4)))
    return forward, gradient.lower(*ARGS).compile()


def check(implementation):
    forward, compiled_gradient = compiled(implementation)
    grads = compiled_gradient(*ARGS)
    pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(EXPECTED_GRADS), strict=True)
    return {
        "forward_collectives": collectives(forward),
        "output_like_q": forward.output_shardings.is_equivalent_to(HEADS, 4),
        "gradient_collectives": collectives(compiled_gradient),
        "dqkv_like_inputs": [g.sharding.is_equivalent_to(HEADS, 4) for g in grads[:3]],
        "value_error": relative_error(forward(*ARGS), EXPECTED),
        "grad_errors": [relative_error(a, b) for a, b in pairs],
    }


ARGS = (q, k, v, prior, ssmax)
reference_forward, reference_gradient = compiled("reference")
EXPECTED, EXPECTED_GRADS = reference_forward(*ARGS), reference_gradient(*ARGS)
print("RESULT" + json.dumps({name: check(name) for name in sys.argv[1:]}))
"""

# "fused" is the native CPU kernel here; the Pallas kernels run in interpret mode.
IMPLEMENTATIONS = ("blockwise", "gpu_interpret") + (("fused",) if HAS_COMPILER else ())


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest) -> dict:
    return host_devices_result(CHECK, *selected_values(request, "implementation"))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_the_forward_computes_per_shard(results, implementation):
    result = results[implementation]
    assert result["forward_collectives"] == [], result["forward_collectives"]
    assert result["output_like_q"]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_the_gradient_only_sums_the_head_parameters_over_batch_shards(results, implementation):
    result = results[implementation]
    kinds = {kind for kind, _ in result["gradient_collectives"]}
    assert kinds <= {"all-reduce"}, result["gradient_collectives"]
    # What is reduced is per-head (a shard's two heads), never as large as q's shard.
    for _, shapes in result["gradient_collectives"]:
        for dims in re.findall(r"\[([\d,]*)\]", shapes):
            size = int(np.prod([int(n) for n in dims.split(",") if n]))
            assert size < 4 * 150 * 4 * 8 // 4, shapes
    assert all(result["dqkv_like_inputs"])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_sharded_values_and_gradients_match_the_reference(results, implementation):
    result = results[implementation]
    assert result["value_error"] < 1e-5, result
    np.testing.assert_array_less(result["grad_errors"], 1e-5)
