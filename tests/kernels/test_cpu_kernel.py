"""The fused kernel's CPU backend (native code through XLA FFI) against the reference.

Cases cover what the kernel's tiling can get wrong: lengths that are not multiples of its
64-query and 256-key tiles, more than one task per (batch row, kv head) (over 512 queries),
documents with padding, SSMax with the prior inside and outside, grouped-query heads,
negative and saturated prior shapes, ALiBi, windows, bidirectional attention, decoding one
query, and head dims that are not whole 16-float vectors. Gradients run the blockwise
backward on the kernel's output and log-sum-exp. Every test here runs the kernel itself,
even for the few queries that fused_attention otherwise hands to blockwise attention.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import platform
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bam_jax import attention_inputs
from bam_jax.attention import dot_product_attention
from bam_jax.attention_spec import AttentionSpec
from bam_jax.fused_attention import fused_attention
from bam_jax.kernels import cpu
from bam_jax.kernels.registry import FUSED_BACKENDS
from tests.support.attention_cases import (
    CPU_KERNEL_CASES,
    Case,
    attention_kwargs,
    check_gradients,
    check_values,
    make_inputs,
    run_kernel,
    run_reference,
)
from tests.support.cpu_compiler import needs_compiler
from tests.support.float64 import float64_attention, x64_mode
from tests.support.processes import run_python

pytestmark = needs_compiler


@pytest.fixture(autouse=True)
def every_query_count_runs_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    every_call = dataclasses.replace(FUSED_BACKENDS["cpu"], min_queries=0)
    monkeypatch.setitem(FUSED_BACKENDS, "cpu", every_call)


@pytest.mark.parametrize("name", sorted(CPU_KERNEL_CASES))
def test_values_match_reference(name: str) -> None:
    inputs, out = check_values(CPU_KERNEL_CASES[name], "cpu")
    if inputs["q_seg"] is not None:
        padding = np.asarray(inputs["q_seg"]) < 0
        assert padding.any()
        np.testing.assert_array_equal(np.asarray(out)[padding], 0.0)


@pytest.mark.parametrize(
    "case",
    [
        Case(q_len=90, documents=True, ssmax=True, theta_mu=0.4, ssmax_max_count=40, batch=1),
        Case(
            q_len=40,
            offset=270,
            prior="alibi",
            ssmax=True,
            prior_inside=False,
            kv_heads=1,
            batch=1,
        ),
    ],
    ids=str,
)
def test_gradients_match_reference(case: Case) -> None:
    check_gradients(case, "cpu")


INFERENCE_FORM_CASE = Case(
    q_len=40, offset=5, prior="ggd_inference", ssmax=True, theta_mu=0.4, batch=1
)


def test_the_inference_form_of_the_ggd_prior_goes_through_its_bias() -> None:
    check_values(INFERENCE_FORM_CASE, "cpu")


@pytest.mark.slow
def test_the_inference_form_gradients_match_reference() -> None:
    check_gradients(INFERENCE_FORM_CASE, "cpu")


@pytest.mark.slow
def test_window_over_long_cache_gradients_match_reference() -> None:
    case = Case(q_len=70, kv_len=900, offset=777, window=16, ssmax=True, batch=1)
    check_gradients(case, "cpu")


def test_cutting_a_window_from_a_long_cache_changes_no_bit(monkeypatch) -> None:
    case = Case(q_len=300, kv_len=5000, offset=3001, window=16, ssmax=True, batch=1)
    inputs = make_inputs(case)
    cut = run_kernel(case, "cpu", inputs)
    monkeypatch.setattr(
        attention_inputs, "window_keys", lambda k, v, seg, off, **_: (k, v, seg, off)
    )
    np.testing.assert_array_equal(cut, run_kernel(case, "cpu", inputs))


def test_implementation_pallas_on_cpu_is_the_cpu_kernel() -> None:
    case = CPU_KERNEL_CASES["chunked_prefill_alibi_ssmax_outside"]
    inputs = make_inputs(case)
    kwargs = dict(prior=inputs["prior"], ssmax_scale_H=inputs["ssmax"], query_offset=case.offset)
    args = (inputs["q"], inputs["k"], inputs["v"])
    spec = AttentionSpec(ssmax_prior_inside=False)
    chosen = dot_product_attention(*args, spec.replace(implementation="fused"), **kwargs)
    kernel = fused_attention(*args, spec, **kwargs, backend="cpu")
    np.testing.assert_array_equal(chosen, kernel)
    np.testing.assert_allclose(chosen, run_reference(case, inputs), atol=2e-5, rtol=2e-5)


def test_traced_query_offset_under_jit_and_bfloat16() -> None:
    case = Case(q_len=70, offset=200, ssmax=True)
    inputs = make_inputs(case)
    run = jax.jit(lambda offset, q: run_kernel(case, "cpu", dict(inputs, q=q), query_offset=offset))
    np.testing.assert_allclose(
        run(jnp.int32(case.offset), inputs["q"]), run_reference(case, inputs), atol=2e-5, rtol=2e-5
    )
    out = run(jnp.int32(case.offset), inputs["q"].astype(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    expected = run_reference(case, dict(inputs, q=inputs["q"].astype(jnp.bfloat16)))
    np.testing.assert_allclose(
        out.astype(jnp.float32), expected.astype(jnp.float32), atol=3e-2, rtol=3e-2
    )


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_results_do_not_depend_on_the_thread_count() -> None:
    # The kernel reads the CPUs it may use at every call: one compiled call, run on every
    # CPU and then with all of the process's threads pinned to one.
    script = """
        import os
        import numpy as np
        from bam_jax.kernels import cpu
        from tests.support.attention_cases import CPU_KERNEL_CASES
        from tests.support.attention_cases import make_inputs, run_kernel

        case = CPU_KERNEL_CASES["long_prefill_two_tasks_many_key_tiles"]
        inputs = make_inputs(case)
        many = cpu.kernel_threads()
        first = np.asarray(run_kernel(case, "cpu", inputs))
        one_cpu = {min(os.sched_getaffinity(0))}
        for thread in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(thread), one_cpu)
        assert many >= 2 and cpu.kernel_threads() == 1, (many, cpu.kernel_threads())
        np.testing.assert_array_equal(first, np.asarray(run_kernel(case, "cpu", inputs)))
    """
    run_python(script)


def test_a_nan_query_gives_nan_output_in_its_row_only() -> None:
    case = Case(q_len=70, prior=None)
    inputs = make_inputs(case)
    q = inputs["q"].at[0, 5, 1, 3].set(jnp.nan)
    out = np.array(run_kernel(case, "cpu", dict(inputs, q=q)))
    assert np.isnan(out[0, 5, 1]).all()
    out[0, 5, 1] = 0.0
    assert np.isfinite(out).all()


def test_no_queries_or_no_keys_give_zeros() -> None:
    q = jnp.ones((2, 8, 4, 16))
    for q_len, kv_len in ((0, 8), (8, 0)):
        k = v = jnp.ones((2, kv_len, 2, 16))
        out = fused_attention(q[:, :q_len], k, v, backend="cpu")
        assert out.shape == (2, q_len, 4, 16)
        np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_options_the_cpu_kernel_does_not_have_raise() -> None:
    x = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(ValueError, match="no interpret mode"):
        fused_attention(x, x, x, backend="cpu", interpret=True)
    with pytest.raises(NotImplementedError, match="backward='blockwise'"):
        fused_attention(x, x, x, backend="cpu", backward="fused")


def test_a_missing_compiler_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler++")
    monkeypatch.setenv("BAM_JAX_KERNEL_CACHE", str(tmp_path))
    with pytest.raises(
        cpu.CpuKernelUnavailable, match=r"no-such-compiler.*implementation='blockwise'"
    ):
        cpu._build()


def test_a_failed_compilation_shows_the_compiler_s_message_and_caches_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu, "SOURCE", broken)
    monkeypatch.setenv("BAM_JAX_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(cpu.CpuKernelUnavailable, match=r"broken\.cc"):
        cpu._build()
    assert not list((tmp_path / "cache").glob("*.so"))


def test_the_build_is_cached_by_source(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    compiled = []

    def fake_compile(compiler, flags, path):
        compiled.append(path)
        path.write_bytes(b"")
        cpu._digest_path(path).write_text(cpu._sha256(path))

    monkeypatch.setattr(cpu, "_compile", fake_compile)
    monkeypatch.setenv("BAM_JAX_KERNEL_CACHE", str(tmp_path))
    first = cpu._build()
    assert cpu._build() == first and compiled == [first]
    changed = tmp_path / "cpu_attention.cc"
    changed.write_text(cpu.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(cpu, "SOURCE", changed)
    assert cpu._build() != first and len(compiled) == 2
    assert cpu._build(extra_flags=("-mno-avx512f",)) not in compiled[:2]


def test_evaluation_runs_the_cpu_kernel_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from bam_jax.implementation import resolve_implementation

    monkeypatch.setattr(cpu, "_cpu_may_have_avx512", lambda: True)
    monkeypatch.setattr(cpu, "_built_with_avx512", lambda library: True)
    monkeypatch.delenv(cpu.SWITCH_ENV, raising=False)
    assert resolve_implementation(purpose="inference") == "fused"
    assert resolve_implementation("auto", purpose="inference") == "fused"
    assert resolve_implementation("blockwise", purpose="inference") == "blockwise"
    assert resolve_implementation() == "blockwise"  # training: the kernel's backward is blockwise
    with pytest.raises(ValueError, match="--attention must be one of"):
        resolve_implementation("flash", purpose="inference", field="--attention")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="-mno-avx512f is an x86 flag")
def test_the_portable_build_matches_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    # What machines without AVX-512 run: the generic vector code instead of the intrinsics.
    library = ctypes.cdll.LoadLibrary(str(cpu._build(extra_flags=("-mno-avx512f",))))
    assert not cpu._built_with_avx512(library)
    cpu_has_avx512 = " avx512f" in Path("/proc/cpuinfo").read_text()
    assert cpu._built_with_avx512(cpu._register()) == cpu_has_avx512
    name = "bam_cpu_attention_forward_portable"
    jax.ffi.register_ffi_target(
        name, jax.ffi.pycapsule(library.BamCpuAttentionForward), platform="cpu"
    )
    monkeypatch.setattr(cpu, "TARGET_NAME", name)
    check_values(CPU_KERNEL_CASES["saturated_prior_documents_ssmax_outside"], "cpu")
    check_values(CPU_KERNEL_CASES["long_prefill_two_tasks_many_key_tiles"], "cpu")


def test_sharp_logits_that_keep_raising_the_row_shift() -> None:
    # Logits spread over hundreds of log2 units: within a tile, later (farther) keys beat the
    # row's shift by more than the kernel's slack, so stored probabilities are rescaled. At
    # this sharpness float32 rounding of the logits alone moves outputs by ~1e-4, so each
    # float32 program is measured against float64: the kernel must be as close as the float32
    # oracle and blockwise attention are (two float32 programs that round alike can agree
    # with each other far better than either agrees with the exact values).
    case = Case(q_len=200, kv_len=700, offset=500, ssmax=True, betas=(-0.6, 0.0, 0.5))
    inputs = make_inputs(case)
    sharp = dict(inputs, q=inputs["q"] * 12.0)
    with x64_mode():
        prior_arrays = jax.tree.leaves(sharp["prior"])
        arrays = (sharp["q"], sharp["k"], sharp["v"], *prior_arrays, sharp["ssmax"])
        exact_attention = functools.partial(
            float64_attention, case.prior_inside, None, query_offset=case.offset
        )
        exact = np.asarray(jax.jit(exact_attention)(*(jnp.asarray(x, jnp.float64) for x in arrays)))
    kwargs = attention_kwargs(case, sharp, implementation="blockwise", block_q=None, block_k=None)
    blockwise = jax.jit(functools.partial(dot_product_attention, **kwargs))(
        sharp["q"], sharp["k"], sharp["v"]
    )

    def error(output: jax.Array) -> float:
        return float(np.max(np.abs(np.asarray(output, np.float64) - exact)))

    float32_error = max(error(run_reference(case, sharp)), error(blockwise))
    assert float32_error < 1e-3
    assert error(run_kernel(case, "cpu", sharp)) <= 1.5 * float32_error


def test_a_library_that_does_not_load_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    damaged = tmp_path / "cpu_attention-damaged.so"
    damaged.write_bytes(b"not a shared library")
    monkeypatch.setattr(cpu, "_build", lambda: damaged)
    with pytest.raises(cpu.CpuKernelUnavailable, match=r"cpu_attention-damaged\.so"):
        cpu._register.__wrapped__()


def test_the_native_source_reads_the_head_parameter_layout_of_tile_math() -> None:
    from bam_jax.kernels import tile_math

    source = (Path(cpu.__file__).parent / "cpu_attention.cc").read_text(encoding="utf-8")
    constants = {
        name: int(value) for name, value in re.findall(r"constexpr int (k\w+) = (\d+);", source)
    }
    assert constants["kHeadParams"] == tile_math.NUM_HEAD_PARAMS
    assert constants["kSsmaxColumn"] == tile_math.SSMAX_SCALE
    assert len(tile_math.HEAD_PARAM_COLUMNS) <= tile_math.NUM_HEAD_PARAMS
