"""The CPU kernel under a mesh of 4 fake CPU devices (in a subprocess, since the device count
is fixed when jax starts): each device computes its own batch rows and kv heads, with no
collective in the forward, and values equal the unsharded call bit for bit; gradients
(the blockwise backward on the sharded output) match the unsharded ones. Dimensions the
rule cannot shard (sequence, kv heads fewer than the devices) are gathered, still exact;
under vmap the kernel runs per index.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bam_jax.fused_attention import fused_attention
from tests.support.cpu_compiler import needs_compiler
from tests.support.grids import selected_values, slow_unless
from tests.support.host_devices import host_devices_result

pytestmark = needs_compiler

# name: (case, mesh axes and sizes, q's spec [B, T, H, D], k's and v's spec [B, S, K, D]).
CASES = """
from tests.support.attention_cases import Case

CASES = {
    "batch_ggd_ssmax": (
        Case(q_len=70, batch=4, ssmax=True),
        {"data": 4}, ("data",), ("data",),
    ),
    "heads_gqa_2x2_documents_offset": (
        Case(q_len=70, offset=5, documents=True, ssmax=True, heads=4, kv_heads=2),
        {"data": 2, "model": 2}, ("data", None, "model"), ("data", None, "model"),
    ),
    "heads_only_ssmax_outside": (
        Case(q_len=80, batch=1, heads=8, kv_heads=4, ssmax=True, prior_inside=False),
        {"model": 4}, (None, None, "model"), (None, None, "model"),
    ),
    "batch_over_two_axes_alibi_documents": (
        Case(q_len=72, batch=4, prior="alibi", documents=True),
        {"data": 2, "model": 2}, (("data", "model"),), (("data", "model"),),
    ),
    "sequence_gathered": (
        Case(q_len=64, ssmax=True),
        {"data": 4}, (None, "data"), (None, "data"),
    ),
    "single_kv_head_query_heads_sharded": (
        Case(q_len=96, heads=4, kv_heads=1, documents=True),
        {"model": 4}, (None, None, "model"), (),
    ),
    "kv_heads_fewer_than_devices_gathered": (
        Case(q_len=64, heads=4, kv_heads=2, ssmax=True),
        {"model": 4}, (None, None, "model"), (),
    ),
}
"""
SHARDED_CASES = (
    "batch_ggd_ssmax",
    "heads_gqa_2x2_documents_offset",
    "heads_only_ssmax_outside",
    "batch_over_two_axes_alibi_documents",
    "single_kv_head_query_heads_sharded",
)
GATHERED_CASES = ("sequence_gathered", "kv_heads_fewer_than_devices_gathered")
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")

CHECK = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from bam_jax.kernels.cpu import TARGET_NAME
from bam_jax.fused_attention import fused_attention
from tests.support.attention_cases import attention_kwargs, make_inputs

COLLECTIVES = {collectives!r}


def relative_error(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def count_ops(hlo, name):
    return hlo.count(name + "(") + hlo.count(name + "-start(")


def attention(case, q, k, v, prior, ssmax, q_seg, k_seg):
    inputs = dict(q=q, k=k, v=v, prior=prior, ssmax=ssmax, q_seg=q_seg, k_seg=k_seg)
    kwargs = attention_kwargs(case, inputs)
    return fused_attention(q, k, v, **kwargs, backend="cpu")


def loss(case, weights, *args):
    return (attention(case, *args) * weights).sum()


def run(case, args, weights):
    forward = jax.jit(lambda *a: attention(case, *a))
    gradient = jax.jit(jax.grad(lambda *a: loss(case, weights, *a), argnums=(0, 1, 2, 3, 4)))
    return forward, forward(*args), gradient(*args)


def check(case, axes, q_spec, k_spec):
    inputs = make_inputs(case)
    names = ("q", "k", "v", "prior", "ssmax", "q_seg", "k_seg")
    args = [inputs[name] for name in names]
    weights = jnp.asarray(np.random.default_rng(1).normal(size=inputs["q"].shape), jnp.float32)
    _, out, grads = run(case, args, weights)

    devices = np.array(jax.devices()[:4]).reshape(tuple(axes.values()))
    mesh = Mesh(devices, tuple(axes))
    q_sharding = NamedSharding(mesh, P(*q_spec))
    k_sharding = NamedSharding(mesh, P(*k_spec))
    seg_sharding = NamedSharding(mesh, P(q_spec[0]))
    shardings = (q_sharding, k_sharding, k_sharding, None, None, seg_sharding, seg_sharding)
    sharded = [
        x if x is None or s is None else jax.device_put(x, s) for x, s in zip(args, shardings)
    ]
    weights = jax.device_put(weights, q_sharding)
    forward, sharded_out, sharded_grads = run(case, sharded, weights)
    compiled = forward.lower(*sharded).compile()
    hlo = compiled.as_text()
    pairs = zip(jax.tree.leaves(sharded_grads), jax.tree.leaves(grads), strict=True)
    return {{
        "values_equal": bool(np.array_equal(np.asarray(sharded_out), np.asarray(out))),
        "grad_errors": [relative_error(a, b) for a, b in pairs],
        "collectives": {{name: count_ops(hlo, name) for name in COLLECTIVES}},
        "kernel_calls": hlo.count(TARGET_NAME),
        "output_like_q": compiled.output_shardings.is_equivalent_to(q_sharding, 4),
        "result_like_q": sharded_out.sharding.is_equivalent_to(q_sharding, 4),
        "shards": [list(s.data.shape) for s in sharded_out.addressable_shards],
    }}


results = {{"shardy": bool(jax.config.jax_use_shardy_partitioner)}}
for name in sys.argv[1:]:
    results[name] = check(*CASES[name])
print("RESULT" + json.dumps(results))
"""


# The default suite's cases: batch, heads with grouped queries, a single key head, and one
# gathered dimension; the rest are slow.
DEFAULT_CASES = (
    "batch_ggd_ssmax",
    "heads_gqa_2x2_documents_offset",
    "single_kv_head_query_heads_sharded",
    "kv_heads_fewer_than_devices_gathered",
)


def _run_checks(names: Iterable[str], shardy: bool = True) -> dict:
    code = textwrap.dedent(CASES) + CHECK.format(collectives=COLLECTIVES)
    env = {"JAX_USE_SHARDY_PARTITIONER": str(shardy).lower()}
    return host_devices_result(code, *names, env=env)


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest) -> dict:
    """One subprocess checks every case that this session's selected tests ask for."""
    return _run_checks(selected_values(request, "name"))


def _check_values_and_gradients(result: dict) -> None:
    assert result["kernel_calls"] >= 1, "the forward did not run the CPU kernel"
    assert result["values_equal"], "the sharded forward differs from the unsharded one"
    np.testing.assert_array_less(result["grad_errors"], 1e-5)


def _check_per_shard(result: dict) -> None:
    assert result["collectives"] == dict.fromkeys(COLLECTIVES, 0), result["collectives"]
    assert result["output_like_q"] and result["result_like_q"], result["shards"]


@pytest.mark.parametrize("name", slow_unless(SHARDED_CASES + GATHERED_CASES, DEFAULT_CASES))
def test_values_and_gradients_match_the_unsharded_call(results, name):
    _check_values_and_gradients(results[name])


@pytest.mark.parametrize("name", slow_unless(SHARDED_CASES, DEFAULT_CASES))
def test_forward_computes_per_shard_without_collectives(results, name):
    assert results["shardy"]
    _check_per_shard(results[name])


@pytest.mark.parametrize("name", slow_unless(GATHERED_CASES, DEFAULT_CASES))
def test_dimensions_the_rule_cannot_shard_are_gathered(results, name):
    assert results[name]["collectives"]["all-gather"] > 0


@pytest.mark.slow
def test_gspmd_partitioner_shards_the_same_way():
    names = ("batch_ggd_ssmax", "heads_gqa_2x2_documents_offset")
    results = _run_checks(names, shardy=False)
    assert not results["shardy"]
    for name in names:
        _check_values_and_gradients(results[name])
        _check_per_shard(results[name])


def test_vmap_runs_the_kernel_per_index():
    rng = np.random.default_rng(0)
    q_VxBxTxHxD = jnp.asarray(rng.normal(size=(3, 2, 64, 4, 16)), jnp.float32)
    k_VxBxSxKxD = jnp.asarray(rng.normal(size=(3, 2, 64, 2, 16)), jnp.float32)

    def attention(q, k):
        return fused_attention(q, k, k, backend="cpu")

    vmapped = jax.jit(jax.vmap(attention))(q_VxBxTxHxD, k_VxBxSxKxD)
    for index in range(3):
        one = attention(q_VxBxTxHxD[index], k_VxBxSxKxD[index])
        np.testing.assert_array_equal(vmapped[index], one)
    grads = jax.vmap(jax.grad(lambda q, k: attention(q, k).sum()))(q_VxBxTxHxD, k_VxBxSxKxD)
    assert grads.shape == q_VxBxTxHxD.shape and bool(jnp.all(jnp.isfinite(grads)))
