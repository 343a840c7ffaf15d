"""The CPU kernel's build, cache and choice: what happens when something is wrong.

A damaged library is rebuilt, never loaded; a cache that other users can write is refused;
a cache that cannot be used, a failed build or a build without AVX-512 leaves automatic
choices on blockwise attention; the switch turns the kernel off; a compiler command may
carry arguments; a failed build is not retried; windows beyond int32 positions, thread
limits, bfloat16 inputs and decode steps behave. Builds go into temporary caches.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bam_jax.blockwise import blockwise_attention
from bam_jax.io import private
from bam_jax.kernels import cpu
from tests.support.attention_cases import (
    Case,
    attention_kwargs,
    check_values,
    make_inputs,
    run_kernel,
)
from tests.support.cpu_compiler import needs_compiler
from tests.support.processes import run_python
from tests.support.thread_cap import build_thread_cap

pytestmark = needs_compiler
TINY_SOURCE = 'extern "C" int BamCpuAttentionHasAvx512() { return 1; }\n'


@pytest.fixture(scope="module", autouse=True)
def private_kernel_cache(tmp_path_factory: pytest.TempPathFactory):
    """These tests damage and rebuild the cached kernel: a cache of their own, not the
    session's that other tests load concurrently."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cpu.CACHE_ENV, str(tmp_path_factory.mktemp("kernel_cache")))
        yield


@pytest.fixture
def fresh_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The choice's switch and log-once memory as in a new process."""
    monkeypatch.setattr(cpu, "_logged", set())
    monkeypatch.setattr(cpu, "_failed_builds", {})
    monkeypatch.setattr(cpu, "_switch_override", None)
    monkeypatch.delenv(cpu.SWITCH_ENV, raising=False)


@pytest.fixture
def tiny_source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A source that compiles in a moment, for tests of the build machinery."""
    source = tmp_path / "tiny.cc"
    source.write_text(TINY_SOURCE)
    monkeypatch.setattr(cpu, "SOURCE", source)
    return source


def fake_compile(compiler, flags, path: Path) -> None:
    path.write_bytes(b"library")
    cpu._digest_path(path).write_text(cpu._sha256(path))


def test_a_truncated_library_is_rebuilt_not_loaded(tmp_path: Path) -> None:
    built = cpu._build()
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    library = cache / built.name
    shutil.copy2(built, library)
    shutil.copy2(cpu._digest_path(built), cpu._digest_path(library))
    library.write_bytes(built.read_bytes()[: built.stat().st_size // 2])
    # In a subprocess: mapping the truncated file would be SIGBUS.
    run_python(f"""
        import os
        os.environ["{cpu.CACHE_ENV}"] = {str(cache)!r}
        import jax.numpy as jnp
        from bam_jax.fused_attention import fused_attention
        x = jnp.ones((1, 70, 2, 16))
        assert float(fused_attention(x, x, x, backend="cpu").sum()) == 70 * 2 * 16
    """)
    assert library.read_bytes() == built.read_bytes()


def test_a_library_that_does_not_match_its_digest_is_rebuilt(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_source: Path
) -> None:
    monkeypatch.setenv(cpu.CACHE_ENV, str(tmp_path / "cache"))
    library = cpu._build()
    good = library.read_bytes()
    library.write_bytes(b"\x7fELF not what was compiled")
    assert cpu._build() == library and library.read_bytes() == good


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o757])
def test_a_cache_directory_others_can_write_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: int
) -> None:
    monkeypatch.setattr(cpu, "_compile", fake_compile)
    monkeypatch.setattr(private, "private_group", lambda gid, uid: False)
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(mode)
    monkeypatch.setenv(cpu.CACHE_ENV, str(cache))
    refused = rf"directory {re.escape(str(cache))} is writable by .*{cpu.CACHE_ENV}"
    with pytest.raises(cpu.CpuKernelUnavailable, match=refused):
        cpu._build()
    assert not list(cache.iterdir())
    inner = cache / "kernels"
    inner.mkdir(mode=0o700)
    monkeypatch.setenv(cpu.CACHE_ENV, str(inner))
    with pytest.raises(cpu.CpuKernelUnavailable, match=refused):
        cpu._build()


def test_a_sticky_shared_directory_is_used_with_private_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(cpu, "_compile", fake_compile)
    cache = tmp_path / "sticky"
    cache.mkdir()
    cache.chmod(0o1777)
    monkeypatch.setenv(cpu.CACHE_ENV, str(cache))
    library = cpu._build()
    library.chmod(0o666)
    refused = rf"file {re.escape(str(library))} is writable by every user"
    with pytest.raises(cpu.CpuKernelUnavailable, match=refused):
        cpu._build()


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_files_and_directories_of_another_user_are_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(cpu, "_compile", fake_compile)
    monkeypatch.setenv(cpu.CACHE_ENV, str(tmp_path / "cache"))
    library = cpu._build()
    os.chown(library, 12345, 12345)
    refused = rf"file {re.escape(str(library))} belongs to uid 12345"
    with pytest.raises(cpu.CpuKernelUnavailable, match=refused):
        cpu._build()
    os.chown(library, 0, 0)
    os.chown(library.parent, 12345, 12345)
    with pytest.raises(cpu.CpuKernelUnavailable, match=r"directory .*belongs to uid 12345"):
        cpu._build()


def test_the_build_key_differs_between_users(monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = cpu._compiler()
    mine = cpu._build_key(compiler, cpu._FLAGS)
    monkeypatch.setattr(os, "getuid", lambda: 12345)
    assert cpu._build_key(compiler, cpu._FLAGS) != mine


def test_an_unwritable_cache_leaves_evaluation_on_blockwise(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    fresh_choice: None,
) -> None:
    from bam_jax.implementation import resolve_implementation

    monkeypatch.setattr(cpu, "_register", functools.cache(cpu._register.__wrapped__))

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    monkeypatch.setattr(cpu, "_cpu_may_have_avx512", lambda: True)
    monkeypatch.setenv(cpu.CACHE_ENV, str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="bam.kernels"):
        assert resolve_implementation(purpose="inference") == "blockwise"
        assert resolve_implementation(purpose="inference") == "blockwise"
    assert len(caplog.records) == 1
    assert "Read-only file system" in caplog.text and cpu.CACHE_ENV in caplog.text


def test_a_cache_path_through_a_file_is_unavailable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(cpu.CACHE_ENV, str(blocker / "cache"))
    unusable = rf"{re.escape(str(blocker / 'cache'))} cannot be used .*{cpu.CACHE_ENV}"
    with pytest.raises(cpu.CpuKernelUnavailable, match=unusable):
        cpu._build()


def test_a_compiler_command_with_arguments(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_source: Path
) -> None:
    compiler = cpu._compiler()[0]
    monkeypatch.setenv("CXX", f"env LC_ALL=C {compiler}")
    monkeypatch.setenv(cpu.CACHE_ENV, str(tmp_path / "cache"))
    assert cpu._compiler() == (shutil.which("env"), "LC_ALL=C", compiler)
    assert cpu._build().stat().st_size > 0


def test_a_failed_build_is_not_retried(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu, "SOURCE", broken)
    monkeypatch.setenv(cpu.CACHE_ENV, str(tmp_path / "cache"))
    runs = []
    real_run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: runs.append(a) or real_run(*a, **k))
    with pytest.raises(cpu.CpuKernelUnavailable, match=r"broken\.cc") as first:
        cpu._build()
    assert runs
    runs.clear()
    with pytest.raises(cpu.CpuKernelUnavailable) as second:
        cpu._build()
    assert second.value is first.value and not runs


def test_the_switch_turns_the_kernel_off_and_on(
    monkeypatch: pytest.MonkeyPatch, fresh_choice: None
) -> None:
    from bam_jax.implementation import resolve_implementation

    monkeypatch.setattr(cpu, "_built_with_avx512", lambda library: False)
    assert not cpu.cpu_kernel_preferred()
    for value in ("1", "on", "ON"):
        monkeypatch.setenv(cpu.SWITCH_ENV, value)
        assert cpu.cpu_kernel_preferred() and resolve_implementation(purpose="inference") == "fused"
    cpu.use_cpu_kernel(False)
    assert resolve_implementation(purpose="inference") == "blockwise"
    monkeypatch.setattr(cpu, "_register", lambda: pytest.fail("built although switched off"))
    for value in ("0", "off"):
        cpu.use_cpu_kernel(None)
        monkeypatch.setenv(cpu.SWITCH_ENV, value)
        assert not cpu.cpu_kernel_preferred()
    monkeypatch.setenv(cpu.SWITCH_ENV, "sometimes")
    with pytest.raises(ValueError, match=rf"\${cpu.SWITCH_ENV} must be one of"):
        cpu.cpu_kernel_preferred()
    with pytest.raises(ValueError, match="use_cpu_kernel takes True, False or None"):
        cpu.use_cpu_kernel("yes")


def test_automatic_choice_needs_an_avx512_build(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_choice: None
) -> None:
    from bam_jax.implementation import resolve_implementation

    monkeypatch.setattr(cpu, "_cpu_may_have_avx512", lambda: True)
    monkeypatch.setattr(cpu, "_built_with_avx512", lambda library: False)
    with caplog.at_level(logging.INFO, logger="bam.kernels"):
        assert resolve_implementation(purpose="inference") == "blockwise"
    assert "without AVX-512" in caplog.text
    monkeypatch.setattr(cpu, "_built_with_avx512", lambda library: True)
    assert resolve_implementation(purpose="inference") == "fused"
    monkeypatch.setattr(cpu, "_cpu_may_have_avx512", lambda: False)
    monkeypatch.setattr(cpu, "_register", lambda: pytest.fail("built on a CPU without AVX-512"))
    assert resolve_implementation(purpose="inference") == "blockwise"


@pytest.mark.parametrize("window", [2**31 - 1, 2**31, 2**40])
def test_a_window_beyond_int32_positions_sees_every_key(window: int) -> None:
    for causal in (True, False):
        case = Case(q_len=70, offset=30, prior="alibi", causal=causal)
        inputs = make_inputs(case)
        unlimited = np.asarray(run_kernel(case, "cpu", inputs))
        windowed = np.asarray(run_kernel(case, "cpu", inputs, window=window))
        np.testing.assert_array_equal(windowed, unlimited)


def test_thread_limits_do_not_stop_the_kernel(tmp_path: Path) -> None:
    # No thread can be started when the compiled call runs: a preloaded library refuses
    # every pthread_create from inside the process, whatever else runs on the machine. A
    # kernel that started helper threads without coping with a refusal fails here.
    if cpu.kernel_threads() < 2:
        pytest.skip("on one CPU the kernel runs on the calling thread alone")
    cap = build_thread_cap(tmp_path)
    run_python(
        """
        import ctypes, os, threading
        import jax, jax.numpy as jnp, numpy as np
        from bam_jax.fused_attention import fused_attention

        q = jax.random.normal(jax.random.key(0), (1, 600, 4, 64))
        k = jax.random.normal(jax.random.key(1), (1, 900, 2, 64))
        run = jax.jit(lambda q, k: fused_attention(q, k, k, backend="cpu", query_offset=300))
        run = run.lower(q, k).compile()
        expected = np.asarray(run(q, k))
        cap = ctypes.CDLL(os.environ["LD_PRELOAD"])
        cap.bam_refused_threads.restype = ctypes.c_long
        cap.bam_cap_threads(1)
        try:
            threading.Thread(target=lambda: None).start()
            raise SystemExit("a thread could still be started: the cap did not hold")
        except RuntimeError:
            pass
        assert cap.bam_refused_threads() == 1
        np.testing.assert_array_equal(np.asarray(run(q, k)), expected)
        """,
        LD_PRELOAD=str(cap),
    )


def custom_calls(case: Case, **overrides) -> str:
    inputs = make_inputs(case)
    text = jax.jit(lambda q: run_kernel(case, "cpu", dict(inputs, q=q), **overrides))
    return text.lower(inputs["q"]).as_text()


def test_a_decode_step_runs_blockwise_attention() -> None:
    short = Case(q_len=cpu.CPU_MIN_QUERIES - 1, offset=300, ssmax=True, documents=True)
    assert cpu.TARGET_NAME not in custom_calls(short)
    assert cpu.TARGET_NAME in custom_calls(Case(q_len=cpu.CPU_MIN_QUERIES, offset=300))
    single = Case(q_len=1, offset=300, ssmax=True, documents=True)
    inputs, out = check_values(single, "cpu")
    expected = blockwise_attention(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        **attention_kwargs(
            single, inputs, block_q=cpu.CPU_MIN_QUERIES, block_k=cpu.CPU_SHORT_BLOCK_K
        ),
    )
    np.testing.assert_array_equal(out, expected)


def test_bfloat16_inputs_reach_the_kernel_as_bfloat16() -> None:
    case = Case(q_len=70, offset=200, ssmax=True)
    inputs = make_inputs(case)
    half = {name: inputs[name].astype(jnp.bfloat16) for name in ("q", "k", "v")}
    run = jax.jit(lambda q, k, v: run_kernel(case, "cpu", dict(inputs, q=q, k=k, v=v)))
    text = run.lower(*half.values()).as_text()
    call = next(line for line in text.splitlines() if cpu.TARGET_NAME in line)
    assert call.count("xbf16>") >= 3, call
    widened = {name: x.astype(jnp.float32) for name, x in half.items()}
    np.testing.assert_array_equal(
        np.asarray(run(*half.values()), np.float32),
        np.asarray(run_kernel(case, "cpu", dict(inputs, **widened)).astype(jnp.bfloat16)),
    )


def test_a_library_missing_the_feature_test_is_unavailable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_source: Path
) -> None:
    tiny_source.write_text('extern "C" int Unrelated() { return 0; }\n')
    monkeypatch.setenv(cpu.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(cpu.CpuKernelUnavailable, match=r"loading .*\.so failed"):
        cpu._register.__wrapped__()


def test_new_cache_directories_are_private(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cpu, "_compile", fake_compile)
    monkeypatch.setenv(cpu.CACHE_ENV, str(tmp_path / "a" / "cache"))
    library = cpu._build()
    assert stat.S_IMODE(library.parent.stat().st_mode) == 0o700


def test_a_second_library_under_the_kernel_s_name_is_unavailable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cpu._register()
    other = tmp_path / "cpu_attention-other.so"
    shutil.copy2(cpu._build(), other)
    monkeypatch.setattr(cpu, "_build", lambda: other)
    with pytest.raises(cpu.CpuKernelUnavailable, match=r"registering .*other\.so with XLA"):
        cpu._register.__wrapped__()
