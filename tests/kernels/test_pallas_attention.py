"""Pallas kernels (interpret mode on CPU) against the reference oracle.

Both variants run here: "gpu" (Triton semantics, `interpret=True`) and "tpu" (Mosaic
semantics, `pltpu.InterpretParams()`). Lowering tests check that the kernels lower for
CUDA (Triton IR) and TPU (Mosaic) without a device; compiling them needs the hardware.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bam_jax.attention_spec import AttentionSpec
from bam_jax.config import ModelConfig
from bam_jax.fused_attention import fused_attention
from bam_jax.implementation import resolve_implementation
from bam_jax.kernels.lowering import kernel_modules, lower_for, tile_op_counts
from bam_jax.kernels.registry import FUSED_BACKENDS
from bam_jax.masking import AttentionMask, visibility_mask
from tests.support.attention_cases import (
    LOWERING_CASES,
    Case,
    PowerLawPrior,
    attention_kwargs,
    check_gradients,
    check_values,
    make_inputs,
    run_kernel,
    run_reference,
)

# ---------------------------------------------------------------------------------------
# Default suite: a compact grid, both variants.

DEFAULT_VALUE_CASES = {
    "documents_ssmax_inside_gqa_hd48": Case(
        q_len=129,
        documents=True,
        ssmax=True,
        theta_mu=0.4,
        block_q=32,
        block_k=16,
        ssmax_max_count=50,
    ),
    "chunked_prefill_alibi_ssmax_outside": Case(
        q_len=7, offset=57, prior="alibi", ssmax=True, prior_inside=False
    ),
    "decode_single_query": Case(q_len=1, offset=63, kv_len=80, heads=5, kv_heads=1),
    "saturated_prior_documents_ssmax_outside": Case(
        q_len=40, betas=(-8.0, -30.0), documents=True, ssmax=True, prior_inside=False
    ),
}
TABLE_CASES = ("documents_ssmax_inside_gqa_hd48", "saturated_prior_documents_ssmax_outside")


@pytest.mark.parametrize(
    ("name", "backend", "prior_table"),
    [(name, "gpu", False) for name in sorted(DEFAULT_VALUE_CASES)]
    + [(name, "gpu", True) for name in TABLE_CASES]
    + [
        ("documents_ssmax_inside_gqa_hd48", "tpu", False),
        ("chunked_prefill_alibi_ssmax_outside", "tpu", False),
        ("chunked_prefill_alibi_ssmax_outside", "tpu", True),
    ],
)
def test_values_match_reference(name: str, backend: str, prior_table: bool) -> None:
    case = dataclasses.replace(DEFAULT_VALUE_CASES[name], prior_table=prior_table)
    inputs, out = check_values(case, backend)
    if inputs["q_seg"] is not None:
        padding = np.asarray(inputs["q_seg"]) < 0
        assert padding.any()
        np.testing.assert_array_equal(np.asarray(out)[padding], 0.0)


@pytest.mark.slow
def test_gradients_with_saturated_prior_match_reference() -> None:
    check_gradients(DEFAULT_VALUE_CASES["saturated_prior_documents_ssmax_outside"], "gpu")


def test_gradients_match_reference() -> None:
    case = Case(q_len=40, documents=True, ssmax=True, theta_mu=0.4, ssmax_max_count=12)
    inputs, (_, grad_k, grad_v, _, _) = check_gradients(case, "gpu")
    k_padding = np.asarray(inputs["k_seg"]) < 0
    assert k_padding.any()
    for grad in (grad_k, grad_v):
        assert np.all(np.isfinite(np.asarray(grad)))
        np.testing.assert_array_equal(np.asarray(grad)[k_padding], 0.0)


@pytest.mark.slow
def test_capped_ssmax_count_gradients_through_the_blockwise_backward() -> None:
    # The TPU kernel's backward is bam_jax.blockwise.flash_backward: the cap must reach it.
    # (The default suite checks the same path with the CPU kernel,
    # tests/kernels/test_cpu_kernel.py.)
    check_gradients(Case(q_len=24, ssmax=True, ssmax_max_count=10, batch=1), "tpu")


def test_bidirectional_window_with_documents() -> None:
    check_values(Case(q_len=40, causal=False, window=9, documents=True, ssmax=True), "gpu")


def test_traced_query_offset_under_jit() -> None:
    case = Case(q_len=16, offset=40, ssmax=True, prior=None, kv_heads=4)
    inputs = make_inputs(case)

    @jax.jit
    def run(offset):
        return run_kernel(case, "gpu", inputs, query_offset=offset)

    np.testing.assert_allclose(
        run(jnp.int32(case.offset)), run_reference(case, inputs), atol=2e-5, rtol=2e-5
    )


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("causal", [True, False])
def test_visible_key_counts_match_mask(causal: bool, window: int | None) -> None:
    rng = np.random.default_rng(3)
    q_len, kv_len, offset = 9, 30, 17
    k_seg = jnp.asarray(rng.integers(-1, 3, size=(3, kv_len)), jnp.int32)  # interleaved ids
    q_seg = k_seg[:, offset : offset + q_len]
    positions = jnp.arange(q_len) + offset
    mask = AttentionMask(causal, window, kv_len)
    for segs in ((None, None), (q_seg, k_seg)):
        visible = visibility_mask(mask, positions, jnp.arange(kv_len), *segs)
        counts = mask.visible_counts(q_len, offset, *segs)
        np.testing.assert_array_equal(counts, visible.sum(-1))


def test_bad_arguments_raise() -> None:
    case = Case(q_len=8)
    inputs = make_inputs(case)
    with pytest.raises(ValueError, match="query_segment_ids_BxT"):
        run_kernel(case, "gpu", inputs, query_segment_ids_BxT=jnp.zeros((2, 8), jnp.int32))
    with pytest.raises(ValueError, match="backend"):
        run_kernel(case, "cuda", inputs)
    with pytest.raises(ValueError, match="ssmax_scale_H"):
        run_kernel(case, "gpu", inputs, ssmax_scale_H=jnp.ones((3,)))
    with pytest.raises(ValueError, match="query_offset"):
        run_kernel(case, "gpu", inputs, query_offset=-1)
    batch, keys = inputs["k"].shape[:2]
    with pytest.raises(TypeError, match="query_segment_ids_BxT"):
        run_kernel(
            case,
            "gpu",
            inputs,
            query_segment_ids_BxT=jnp.zeros((batch, 8), jnp.float32),
            key_segment_ids_BxS=jnp.zeros((batch, keys), jnp.int32),
        )
    with pytest.raises(ValueError, match="key_segment_ids_BxS"):
        run_kernel(
            case,
            "gpu",
            inputs,
            query_segment_ids_BxT=jnp.zeros((batch, 8), jnp.int32),
            key_segment_ids_BxS=jnp.zeros((1, keys), jnp.int32),
        )
    for block_q, block_k, message in ((512, 64, "block_q"), (128, 256, "block_k"), (48, 64, "")):
        with pytest.raises(ValueError, match=f"{message or 'block_q'} must be a power of two"):
            fused_attention(
                inputs["q"],
                inputs["k"],
                inputs["v"],
                AttentionSpec(block_q=block_q, block_k=block_k),
                backend="gpu",
                interpret=True,
            )
    with pytest.raises(ValueError, match="block_k must be a positive multiple of 8 on TPU"):
        run_kernel(dataclasses.replace(case, block_k=20), "tpu", inputs)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_any_prior_reads_from_the_table(backend: str) -> None:
    case = Case(q_len=40, offset=9, documents=True, ssmax=True)
    prior = PowerLawPrior(jnp.asarray([0.3, 0.1, 1.0, 0.0], jnp.float32))
    inputs = dict(make_inputs(case), prior=prior)
    np.testing.assert_allclose(
        run_kernel(case, backend, inputs), run_reference(case, inputs), atol=2e-5, rtol=2e-5
    )

    def loss(run, weight_H):
        return jnp.sum(run(dict(inputs, prior=PowerLawPrior(weight_H))) ** 2)

    got = jax.jit(jax.grad(functools.partial(loss, functools.partial(run_kernel, case, backend))))(
        prior.weight_H
    )
    want = jax.jit(jax.grad(functools.partial(loss, functools.partial(run_reference, case))))(
        prior.weight_H
    )
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_the_inference_form_of_the_ggd_prior_reads_from_the_table() -> None:
    case = Case(q_len=40, offset=9, prior="ggd_inference", ssmax=True, theta_mu=0.4)
    check_values(case, "gpu")
    check_gradients(case, "gpu")


@pytest.mark.parametrize("prior_table", [pytest.param(False, marks=pytest.mark.slow), True])
def test_largest_gpu_blocks(prior_table: bool) -> None:
    check_values(
        Case(q_len=300, ssmax=True, block_q=256, block_k=128, prior_table=prior_table), "gpu"
    )


def test_no_queries_or_no_keys_give_zeros() -> None:
    q = jnp.ones((2, 8, 4, 16))
    for q_len, kv_len in ((0, 8), (8, 0)):
        k = v = jnp.ones((2, kv_len, 2, 16))
        out = fused_attention(q[:, :q_len], k, v, backend="gpu", interpret=True)
        assert out.shape == (2, q_len, 4, 16)
        np.testing.assert_array_equal(np.asarray(out), 0.0)


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    platform: str
    device_kind: str


def test_dispatch_and_default_implementation(monkeypatch: pytest.MonkeyPatch) -> None:
    # Blockwise everywhere until a device kind has passed bench/accelerator_check/.
    assert resolve_implementation() == "blockwise"
    h200 = FakeDevice("gpu", "NVIDIA H200")
    assert resolve_implementation(device=h200) == "blockwise"
    assert resolve_implementation(device=FakeDevice("tpu", "TPU v5 lite")) == "blockwise"
    validated = dataclasses.replace(FUSED_BACKENDS["gpu"], validated_devices=("NVIDIA H200",))
    monkeypatch.setitem(FUSED_BACKENDS, "gpu", validated)
    assert resolve_implementation(device=h200) == "fused"
    assert resolve_implementation("pallas", device=h200) == "fused"
    a100 = FakeDevice("gpu", "NVIDIA A100-SXM4-80GB")
    assert resolve_implementation(device=a100) == "blockwise"
    assert resolve_implementation(device=FakeDevice("cpu", "NVIDIA H200")) == "blockwise"
    with pytest.raises(ValueError, match=r"implementation must be one of \('auto', 'reference'"):
        resolve_implementation("flash")


def test_default_tiles_are_each_kernel_backend_s_own() -> None:
    # A model or a call that names no tiles gets the kernel's: blockwise's 256-key blocks
    # would exceed Triton's 128 on GPU.
    config = ModelConfig(attention_impl="fused")
    assert (AttentionSpec().block_q, AttentionSpec().block_k) == (None, None)
    case = Case(q_len=40, ssmax=True, block_q=config.block_q, block_k=config.block_k)
    for backend in ("gpu", "tpu"):
        check_values(case, backend)


def lowering_inputs(case: Case) -> tuple[dict, tuple[jax.ShapeDtypeStruct, ...]]:
    """The case's inputs, and q, k, v as bfloat16 shapes (lowering takes shapes)."""
    inputs = make_inputs(case)
    shapes = tuple(jax.ShapeDtypeStruct(inputs[n].shape, jnp.bfloat16) for n in ("q", "k", "v"))
    return inputs, shapes


def lowered_kernel_text(case: Case, platform: str, **options) -> str:
    inputs, shapes = lowering_inputs(case)
    backend = "gpu" if platform == "cuda" else "tpu"

    def forward(q, k, v):
        kwargs = attention_kwargs(case, inputs, block_q=None, block_k=None)
        return fused_attention(q, k, v, **kwargs, backend=backend, **options)

    return lower_for(forward, shapes, platform).as_text()


@pytest.mark.parametrize("prior_table", [False, True])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("name", sorted(LOWERING_CASES))
def test_kernels_lower_for_accelerators(name: str, platform: str, prior_table: bool) -> None:
    text = lowered_kernel_text(LOWERING_CASES[name], platform, prior_table=prior_table)
    assert ("xla.gpu.triton" in text) if platform == "cuda" else ("tpu_custom_call" in text)


PRIOR_VARIANTS = {  # options, tile rows (the GGD reuse splits a 128-row block in two)
    "ggd": ({}, 64),
    "ggd, no reuse": ({"prior_reuse": False}, 128),
    "ggd, exact math": ({"approx_math": False}, 64),
    "ggd, table": ({"prior_table": True}, 128),
}


@pytest.mark.parametrize("variant", sorted(PRIOR_VARIANTS))
def test_gpu_tile_does_no_divide_or_conversion_per_logit(variant: str) -> None:
    # Head dim 128 keeps the [M, 64] logits tile apart from the [64, 128] key tile.
    options, rows = PRIOR_VARIANTS[variant]
    case = Case(q_len=512, head_dim=128, block_q=None, block_k=None)
    inputs, shapes = lowering_inputs(case)

    def forward(q, k, v):
        kwargs = attention_kwargs(case, inputs)
        return fused_attention(q, k, v, **kwargs, backend="gpu", debug=True, **options)

    [module] = kernel_modules(forward, shapes, "cuda")
    counts = tile_op_counts(module, rows, 64)
    assert "divide" not in counts and "int-to-float" not in counts, counts
    # Softmax exp2, plus log2 and exp2 of the GGD shared by the two sub-blocks or not.
    expected = {"ggd": 2.0, "ggd, no reuse": 3.0, "ggd, exact math": 2.0, "ggd, table": 1.0}
    assert counts["special"] == expected[variant], counts
    assert counts.get("gather", 0.0) == (1.0 if options.get("prior_table") else 0.0)


@pytest.mark.parametrize(("prior_table", "special"), [(False, 3.0), (True, 1.0)])
def test_tpu_tile_does_no_divide_or_conversion_per_logit(prior_table: bool, special: float) -> None:
    case = Case(q_len=1024, head_dim=128, block_q=None, block_k=None)
    inputs, shapes = lowering_inputs(case)

    def forward(q, k, v):
        kwargs = attention_kwargs(case, inputs)
        return fused_attention(
            q, k, v, **kwargs, backend="tpu", debug=True, prior_table=prior_table
        )

    [module] = kernel_modules(forward, shapes, "tpu")
    counts = tile_op_counts(module, 256, 256)  # block_q x the key chunk
    assert "divide" not in counts and "int-to-float" not in counts, counts
    assert counts["special"] == special, counts


# ---------------------------------------------------------------------------------------
# Fuller grid: pytest -m slow tests/kernels/test_pallas_attention.py

SLOW_GRID = itertools.product(
    [(1, 0), (7, 0), (64, 0), (129, 0), (7, 33), (64, 65)],  # (q_len, query_offset)
    [False, True],  # documents
    [(False, True), (True, True), (True, False)],  # (ssmax, prior inside)
    [0.0, 0.5],  # theta_mu
    [1, 4],  # kv heads
    [(16, 32), (32, 16)],  # (block_q, block_k)
)
SLOW_CASES = [
    Case(
        q_len=q_len,
        offset=offset,
        documents=docs,
        ssmax=ssmax,
        prior_inside=inside,
        theta_mu=mu,
        kv_heads=kv_heads,
        block_q=bq,
        block_k=bk,
    )
    for (q_len, offset), docs, (ssmax, inside), mu, kv_heads, (bq, bk) in SLOW_GRID
    if not (q_len == 1 and docs)
][::5]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("case", SLOW_CASES, ids=str)
def test_values_full_grid(case: Case, backend: str) -> None:
    check_values(case, backend)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        Case(q_len=129, documents=True, ssmax=True, theta_mu=0.5, block_q=32, block_k=16),
        Case(q_len=129, ssmax=True, prior_inside=False, kv_heads=1),
        Case(q_len=64, offset=65, prior="alibi", ssmax=True, documents=True),
        Case(q_len=64, prior=None, ssmax=True, head_dim=64),
        Case(q_len=50, window=17, ssmax=True, documents=True),
        Case(q_len=1, offset=40, ssmax=True),
        Case(q_len=40, causal=False, window=9, documents=True, ssmax=True, block_q=32, block_k=16),
    ],
    ids=str,
)
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_gradients_full_grid(case: Case, backend: str) -> None:
    check_gradients(case, backend)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        Case(q_len=64, window=20, ssmax=True, block_q=16, block_k=16),
        Case(q_len=100, offset=13, window=21, ssmax=True, documents=True, block_q=64, block_k=16),
        Case(q_len=33, causal=False, ssmax=True, prior="alibi"),
        Case(q_len=64, prior=None, kv_heads=4, block_q=32, block_k=32),
    ],
    ids=str,
)
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_windows_and_plain_attention(case: Case, backend: str) -> None:
    check_values(case, backend)


@pytest.mark.slow
def test_bfloat16_inputs() -> None:
    case = Case(q_len=64, ssmax=True)
    inputs = make_inputs(case)
    inputs_bf16 = {
        **inputs,
        **{name: inputs[name].astype(jnp.bfloat16) for name in ("q", "k", "v")},
    }
    out = run_kernel(case, "gpu", inputs_bf16)
    assert out.dtype == jnp.bfloat16
    expected = run_reference(case, inputs_bf16)
    np.testing.assert_allclose(
        out.astype(jnp.float32), expected.astype(jnp.float32), atol=3e-2, rtol=3e-2
    )
