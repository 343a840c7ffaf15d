"""Attention inside `jax.shard_map` as a user writes it: the default `check_vma=True`, q, k, v
and the segment ids split over a 2 x 2 mesh by batch and heads, the prior and the SSMax
scales by heads. Values and gradients match the reference on the whole arrays, for every
argument at once and for subsets (only the prior and the SSMax scales with q, k and v
closed over; only v), for blockwise attention, the native CPU kernel and the TPU Pallas
kernel in interpret mode. 72 queries in tiles of 32, so the last tile is partial: the native
CPU kernel runs on 64 queries or more, and the TPU interpreter's time grows with its grid
steps. Run in a subprocess on 4 fake CPU devices (the device count is fixed when jax starts)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.cpu_compiler import HAS_COMPILER
from tests.support.host_devices import host_devices_result

CHECK = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, PartitionSpec as P
import bam_jax
from bam_jax.fused_attention import fused_attention
from bam_jax.priors import AlibiPrior, GGDPrior

mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
rng = np.random.default_rng(0)
B, T, H, K, D = 2, 72, 4, 2, 8
q = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
k, v = (jnp.asarray(rng.normal(size=(B, T, K, D)), jnp.float32) for _ in range(2))
segments = jnp.asarray(np.minimum(np.arange(T) // 23, 2)[None].repeat(B, 0), jnp.int32)
ssmax = jnp.asarray(rng.uniform(0.5, 1.5, H), jnp.float32)
PRIORS = {
    "ggd_negative_shape": GGDPrior(
        theta_alpha_H=jnp.log(jnp.asarray([0.1, 0.2, 0.3, 0.5])),
        theta_beta_H=jnp.asarray([-0.6, 0.4, 1.0, 1.7]),
        theta_mu_H=jnp.zeros(H),
    ),
    "alibi": AlibiPrior(slopes_H=bam_jax.alibi_slopes(H)),
}
CASES = {
    "ggd_documents_ssmax_inside": dict(prior="ggd_negative_shape", documents=True, inside=True),
    "alibi_window_ssmax_outside": dict(prior="alibi", documents=False, inside=False, window=9),
}
HEADS = P("data", None, "model", None)


def attention(implementation, case, q, k, v, prior, ssmax, segments):
    ids = segments if case["documents"] else None
    spec = bam_jax.AttentionSpec(
        ssmax_prior_inside=case["inside"], window=case.get("window"), block_q=32, block_k=32,
    )
    arrays = dict(
        prior=prior, ssmax_scale_H=ssmax, query_segment_ids_BxT=ids, key_segment_ids_BxS=ids
    )
    if implementation == "pallas_tpu_interpret":
        return fused_attention(q, k, v, spec, backend="tpu", interpret=True, **arrays)
    spec = spec.replace(implementation=implementation)
    return bam_jax.dot_product_attention(q, k, v, spec, **arrays)


def sharded(implementation, case, prior):
    prior_specs = jax.tree.map(lambda _: P("model"), prior)
    return jax.shard_map(
        lambda *args: attention(implementation, case, *args),
        mesh=mesh,
        in_specs=(HEADS, HEADS, HEADS, prior_specs, P("model"), P("data")),
        out_specs=HEADS,
    )


def relative_error(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


ALL = (0, 1, 2, 3, 4)  # q, k, v, prior, SSMax scales
SUBSETS = (ALL, (3, 4), (2,))


def value_and_gradients(fn, case, argnums=ALL):
    weights = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
    args = (q, k, v, PRIORS[case["prior"]], ssmax, segments)

    def loss(*differentiated):
        chosen = dict(zip(argnums, differentiated))
        out = fn(*(chosen.get(i, x) for i, x in enumerate(args)))
        return jnp.sum(out * weights), out

    value_and_grad = jax.value_and_grad(loss, argnums=tuple(range(len(argnums))), has_aux=True)
    (_, out), grads = jax.jit(value_and_grad)(*(args[i] for i in argnums))
    return out, dict(zip(argnums, grads))


def check(implementation, case, expected, argnums):
    ours = sharded(implementation, case, PRIORS[case["prior"]])
    out, grads = value_and_gradients(ours, case, argnums)
    expected_out, expected_grads = expected
    pairs = [(grads[i], expected_grads[i]) for i in argnums]
    leaves = [pair for a, b in pairs for pair in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    return {
        "value_error": relative_error(out, expected_out),
        "grad_errors": [relative_error(a, b) for a, b in leaves],
    }


results = {}
for name, case in CASES.items():
    reference = lambda *a: attention("reference", case, *a)
    expected = value_and_gradients(reference, case)
    for implementation in sys.argv[1:]:
        for argnums in SUBSETS:
            key = f"{implementation}/{name}/{','.join(map(str, argnums))}"
            results[key] = check(implementation, case, expected, argnums)
print("RESULT" + json.dumps(results))
"""

# "fused" on a CPU is the native kernel; the TPU Pallas kernel runs in interpret mode (the
# GPU one's interpreter cannot run inside shard_map with check_vma=True: jax's interpreter
# indexes the sharded inputs by unsharded grid indices).
IMPLEMENTATIONS = ("blockwise", "pallas_tpu_interpret") + (("fused",) if HAS_COMPILER else ())


@pytest.fixture(scope="module")
def results() -> dict:
    return host_devices_result(CHECK, *IMPLEMENTATIONS)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", ["ggd_documents_ssmax_inside", "alibi_window_ssmax_outside"])
@pytest.mark.parametrize("differentiated", ["0,1,2,3,4", "3,4", "2"])
def test_attention_inside_shard_map_matches_the_reference(
    results, implementation, case, differentiated
):
    result = results[f"{implementation}/{case}/{differentiated}"]
    assert result["value_error"] < 1e-5, result
    assert len(result["grad_errors"]) >= len(differentiated.split(","))  # a prior has 1-3
    np.testing.assert_array_less(result["grad_errors"], 1e-5)
