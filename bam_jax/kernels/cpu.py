"""The CPU forward kernel: bam_jax/kernels/cpu_attention.cc as an XLA FFI custom call.

Pallas has no CPU lowering, so the fused kernel's CPU backend is native code: one task per
(batch row, kv head, up to 8 blocks of CPU_BLOCK_Q queries of every head sharing it) walks
its visible CPU_BLOCK_K-key tiles, each loaded once for all of its query blocks, with the
prior read from the per-head table and the masks and online softmax applied while a tile
is in cache (see the source's header). It runs on XLA's CPU thread pool, on no more threads
than the CPUs the process may use (affinity and cgroup quota, read at every call).

It is compiled on first use with the machine's C++ compiler (`$CXX`, which may carry
arguments, e.g. "ccache g++"; else c++, g++ or clang++) for the running CPU (-march=native)
and cached under `$BAM_JAX_KERNEL_CACHE` (default `$XDG_CACHE_HOME/bam_jax/kernels`, else
~/.cache/bam_jax/kernels), keyed by the source, the flags, the compiler, the CPU, the jax
version and the user, so a changed source or another machine gets its own build. A build
is loaded only if its SHA-256 matches the one recorded beside it when it was compiled (a
truncated or altered file is rebuilt) and if neither it nor the directories holding it can
be written by another user; any failure to build or load raises CpuKernelUnavailable, once
per process for a failed compilation.

Automatic choices (evaluation's default attention) take the kernel only where it is faster
than blockwise attention: `cpu_kernel_preferred()` decides, from `use_cpu_kernel(...)`, then
`$BAM_JAX_CPU_KERNEL`, then whether the build has AVX-512 (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import jax
import jax.numpy as jnp
import numpy as np

from bam_jax.io.private import (
    NotPrivateError,
    check_private,
    make_private_directory,
    user_cache_dir,
)
from bam_jax.kernels.backend import FusedBackend
from bam_jax.kernels.partitioning import (
    FORWARD_OPERAND_ROLES,
    FORWARD_RESULT_ROLES,
    kernel_operand,
    offset_operand,
    partitioned_by_batch_and_heads,
)
from bam_jax.kernels.tile_math import DerivedInputs, KernelConfig

if TYPE_CHECKING:
    from bam_jax.attention_inputs import AttentionInputs

CPU_BLOCK_Q = 64
CPU_BLOCK_K = 256
# Fewer queries than this run blockwise attention instead, in tiles of them x
# CPU_SHORT_BLOCK_K keys (fused_attention): the kernel computes whole CPU_BLOCK_Q-query
# blocks, so a decode step would pay for 64 queries (docs/benchmarks.md).
CPU_MIN_QUERIES = CPU_BLOCK_Q
CPU_SHORT_BLOCK_K = 1024
# jax.export names the target when it refuses to serialise it, so the name says what to do.
TARGET_NAME = "bam_cpu_attention_forward__to_export_use_implementation_blockwise"
SOURCE = Path(__file__).with_name("cpu_attention.cc")
COMPILERS = ("c++", "g++", "clang++")
SWITCH_ENV = "BAM_JAX_CPU_KERNEL"
CACHE_ENV = "BAM_JAX_KERNEL_CACHE"
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread")
# The kernel's positions are int32: any window from 2**31 - 1 up lets every query see every
# key that no window would, so larger ones are passed as this one.
_INT32_MAX = 2**31 - 1
_SWITCH_VALUES = {
    "0": "off",
    "off": "off",
    "false": "off",
    "no": "off",
    "1": "on",
    "on": "on",
    "true": "on",
    "yes": "on",
    "auto": "auto",
    "": "auto",
}

Switch = Literal["on", "off", "auto"]


class CpuKernelUnavailable(RuntimeError):
    """The CPU kernel could not be built or loaded here (no C++ compiler, a failed
    compilation, a cache directory that cannot be written or that other users can write)."""


_LOG = logging.getLogger("bam.kernels")
_switch_override: bool | None = None
_failed_builds: dict[str, CpuKernelUnavailable] = {}
_logged: set[str] = set()


def use_cpu_kernel(enabled: bool | None) -> None:
    """Whether automatic choices may run the CPU kernel: True whenever it builds, False
    never, None (the default) as `$BAM_JAX_CPU_KERNEL` says, else where it is faster than
    blockwise attention. Explicit choices (`implementation="fused"` on CPU,
    `fused_attention(backend="cpu")`) run the kernel whatever this says."""
    global _switch_override
    if enabled not in (True, False, None):
        raise ValueError(f"use_cpu_kernel takes True, False or None, got {enabled!r}")
    _switch_override = enabled


def cpu_kernel_preferred() -> bool:
    """Whether automatic choices run the CPU kernel rather than blockwise attention: the one
    place that decides. Off by `use_cpu_kernel(False)` or `$BAM_JAX_CPU_KERNEL=0|off`; on
    wherever it builds by `use_cpu_kernel(True)` or `=1|on`; otherwise where it builds
    with AVX-512 (without it the kernel is several times slower than blockwise,
    docs/benchmarks.md). A kernel that cannot be built or loaded logs why, once, on the
    "bam.kernels" logger, and is not chosen."""
    switch = _switch()
    if switch == "off":
        return False
    if switch == "auto" and not _cpu_may_have_avx512():
        _log_once(
            logging.INFO,
            f"this CPU has no AVX-512, where the CPU kernel is slower than blockwise "
            f"attention: blockwise attention is used ({SWITCH_ENV}=on runs the kernel anyway)",
        )
        return False
    try:
        library = _register()
    except CpuKernelUnavailable as error:
        _log_once(logging.WARNING, f"{error}; blockwise attention is used instead")
        return False
    if switch == "auto" and not _built_with_avx512(library):
        _log_once(
            logging.INFO,
            f"the CPU kernel built without AVX-512, where it is slower than blockwise "
            f"attention: blockwise attention is used ({SWITCH_ENV}=on runs the kernel anyway)",
        )
        return False
    return True


def kernel_threads() -> int:
    """The threads a kernel call started now would use at most: the CPUs this process may
    run on (affinity), capped by its cgroup's CPU quota. Builds the kernel if needed."""
    return _register().BamCpuAttentionThreads()


def cpu_forward(
    config: KernelConfig,
    q_BxTxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    inputs: AttentionInputs,
    derived: DerivedInputs,
    head_params_HxP: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Output [B, T, H, D] float32 and natural-log log-sum-exp [B, H, T] (+inf for rows
    that see no key). Unpadded inputs, the query offset an int32 scalar; the table is over
    `prior_table_distances`. q, k and v reach the kernel as they are when all three are
    bfloat16 or float32 (a tile is widened to float32 as it is copied), else as float32
    copies."""
    _register()
    head_dim = q_BxTxHxD.shape[3]
    qkv = functools.partial(jnp.asarray, dtype=_input_dtype(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD))
    table_HxX = derived.prior_table_HxX
    table_reversed_HxX = None if table_HxX is None else jnp.flip(table_HxX, axis=1)
    mask = config.mask
    return partitioned_by_batch_and_heads(
        _kernel_call, FORWARD_OPERAND_ROLES, FORWARD_RESULT_ROLES
    )(
        qkv(q_BxTxHxD),
        qkv(k_BxSxKxD),
        qkv(v_BxSxKxD),
        kernel_operand(table_reversed_HxX, jnp.float32),
        kernel_operand(head_params_HxP, jnp.float32),
        kernel_operand(derived.log_n_BxT, jnp.float32),
        kernel_operand(inputs.query_segment_ids_BxT, jnp.int32),
        kernel_operand(inputs.key_segment_ids_BxS, jnp.int32),
        offset_operand(inputs.query_offset),
        causal=np.int64(mask.causal),
        window=np.int64(-1 if mask.window is None else min(mask.window, _INT32_MAX)),
        kv_len=np.int64(mask.kv_len),
        has_prior=np.int64(table_HxX is not None),
        ssmax=np.int64(config.ssmax),
        prior_inside=np.int64(config.prior_inside),
        segments=np.int64(config.segments),
        table_q_len=np.int64(config.padded_q_len),
        content_scale=np.float32(math.log2(math.e) / math.sqrt(head_dim)),
    )


def _kernel_call(q_BxTxHxD: jax.Array, *operands: jax.Array, **attributes: np.generic):
    """The custom call for these shapes (one device's shard under a mesh)."""
    batch, q_len, num_heads, _ = q_BxTxHxD.shape
    call = jax.ffi.ffi_call(
        TARGET_NAME,
        (
            jax.ShapeDtypeStruct(q_BxTxHxD.shape, jnp.float32),
            jax.ShapeDtypeStruct((batch, num_heads, q_len), jnp.float32),
        ),
        vmap_method="sequential",
    )
    return call(q_BxTxHxD, *operands, **attributes)


def _input_dtype(*arrays: jax.Array) -> jnp.dtype:
    if all(x.dtype == jnp.bfloat16 for x in arrays):
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(jnp.float32)


def _switch() -> Switch:
    if _switch_override is not None:
        return "on" if _switch_override else "off"
    value = os.environ.get(SWITCH_ENV, "").strip().lower()
    if value not in _SWITCH_VALUES:
        raise ValueError(
            f"${SWITCH_ENV} must be one of 0, off, 1, on or auto (or unset), got {value!r}"
        )
    return _SWITCH_VALUES[value]


def _cpu_may_have_avx512() -> bool:
    """False only where the CPU surely lacks it (saves compiling a kernel that is not used);
    the build itself has the last word (`_built_with_avx512`)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return True


def _built_with_avx512(library: ctypes.CDLL) -> bool:
    return bool(library.BamCpuAttentionHasAvx512())


def _log_once(level: int, message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        _LOG.log(level, message)


@functools.cache
def _register() -> ctypes.CDLL:
    path = _build()
    try:
        library = ctypes.CDLL(str(path))
        handler = library.BamCpuAttentionForward
        library.BamCpuAttentionHasAvx512.restype = ctypes.c_int
        library.BamCpuAttentionThreads.restype = ctypes.c_int64
    except (OSError, AttributeError) as error:
        raise CpuKernelUnavailable(
            f"loading the compiled CPU kernel {path} failed: {error} (delete it to rebuild)"
        ) from None
    try:
        jax.ffi.register_ffi_target(TARGET_NAME, jax.ffi.pycapsule(handler), platform="cpu")
    except jax.errors.JaxRuntimeError as error:
        raise CpuKernelUnavailable(
            f"registering the compiled CPU kernel {path} with XLA failed: {error}"
        ) from None
    return library


def _build(extra_flags: tuple[str, ...] = ()) -> Path:
    """The compiled library, from the cache if it is there whole (its recorded digest
    matches), else compiled now (atomically: a concurrent or interrupted build never leaves
    a partial file under the final name). A failed compilation raises the same
    CpuKernelUnavailable for the rest of the process, without compiling again."""
    compiler = _compiler()
    flags = (*_FLAGS, *extra_flags, "-isystem", jax.ffi.include_dir())
    key = _build_key(compiler, flags)
    directory = _cache_dir()
    path = directory / f"cpu_attention-{key}.so"
    if str(path) in _failed_builds:
        raise _failed_builds[str(path)]
    try:
        _make_private_directory(directory)
        if not _intact(path):
            _compile_into(compiler, flags, path)
    except OSError as error:
        raise CpuKernelUnavailable(
            f"the CPU kernel's cache directory {directory} cannot be used ({error}): set "
            f"${CACHE_ENV} to a directory of your own that you can write"
        ) from None
    return path


def _compile_into(compiler: tuple[str, ...], flags: tuple[str, ...], path: Path) -> None:
    _LOG.info("compiling the CPU attention kernel into %s (once per machine)", path)
    error = _compile(compiler, flags, path)
    if error is not None:
        failure = CpuKernelUnavailable(
            f"compiling {SOURCE} with {shlex.join(compiler)} failed (fix the compiler or set "
            f"$CXX; implementation='blockwise' computes the same function):\n{error}"
        )
        _failed_builds[str(path)] = failure
        raise failure


def _compiler() -> tuple[str, ...]:
    """The compiler's command: `$CXX` split as a shell would (its first word found on PATH),
    else the first of COMPILERS found."""
    configured = os.environ.get("CXX", "").strip()
    candidates = [shlex.split(configured)] if configured else [[name] for name in COMPILERS]
    for program, *arguments in candidates:
        found = shutil.which(program)
        if found:
            return (found, *arguments)
    tried = [shlex.join(command) for command in candidates]
    raise CpuKernelUnavailable(
        f"the CPU attention kernel needs a C++17 compiler and found none of {tried} "
        "(install g++ or clang++, or set CXX); implementation='blockwise' computes the same "
        "function without it"
    )


def _compile(compiler: tuple[str, ...], flags: tuple[str, ...], path: Path) -> str | None:
    """Compiles into `path` and records its digest beside it; None on success, else the
    compiler's message."""
    with tempfile.TemporaryDirectory(dir=path.parent) as work:
        partial = Path(work) / path.name
        result = subprocess.run(
            [*compiler, *flags, str(SOURCE), "-o", str(partial)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            return result.stderr[-4000:]
        partial.chmod(0o755)
        digest = Path(work) / _digest_path(path).name
        digest.write_text(_sha256(partial))
        digest.chmod(0o644)
        os.replace(partial, path)
        os.replace(digest, _digest_path(path))
    return None


def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _sha256(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _intact(library: Path) -> bool:
    """Whether `library` is there and matches the digest recorded when it was compiled (a
    truncated, damaged or replaced file does not; it is then compiled again). Raises
    CpuKernelUnavailable for a file another user could have written."""
    digest = _digest_path(library)
    for path in (library, digest):
        if not os.path.lexists(path):
            return False
        _check_private(path, path.lstat(), "file")
    if digest.read_bytes().strip() == _sha256(library).encode():
        return True
    _LOG.info("%s does not match its recorded SHA-256 (%s): compiling it again", library, digest)
    return False


def _make_private_directory(directory: Path) -> None:
    with _refused_if_not_private():
        make_private_directory(directory)


def _check_private(path: Path, info: os.stat_result, kind: str) -> None:
    with _refused_if_not_private():
        check_private(path, info, kind)


@contextlib.contextmanager
def _refused_if_not_private():
    """A NotPrivateError inside becomes CpuKernelUnavailable, saying what to do."""
    try:
        yield
    except NotPrivateError as err:
        raise CpuKernelUnavailable(
            f"the CPU kernel's cache {err}, so another user could replace the library it "
            f"would load; it is not loaded. Remove other users' write access (chmod go-w "
            f"{err.path}), delete it, or set ${CACHE_ENV} to a directory of your own"
        ) from None


def _cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else user_cache_dir("kernels")


def _build_key(compiler: tuple[str, ...], flags: tuple[str, ...]) -> str:
    parts = (SOURCE.read_bytes().decode(), shlex.join(compiler), _compiler_version(compiler))
    # jaxlib is released in step with jax; the user keeps a shared cache's builds apart.
    parts = (*parts, " ".join(flags), _cpu_identity(), jax.__version__, str(os.getuid()))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


@functools.cache
def _compiler_version(compiler: tuple[str, ...]) -> str:
    try:
        result = subprocess.run(
            [*compiler, "--version"], capture_output=True, text=True, check=False
        )
    except OSError as error:
        raise CpuKernelUnavailable(
            f"running the C++ compiler {shlex.join(compiler)} failed ({error}); set $CXX to "
            "a working compiler"
        ) from None
    return result.stdout


def _cpu_identity() -> str:
    """The CPU's model and instruction-set flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.startswith(wanted)}))


def choose_blocks(interpret, head_dim, q_len, kv_len, block_q, block_k) -> tuple[int, int]:
    """The native kernel's tiles are fixed; block_q and block_k are ignored."""
    return CPU_BLOCK_Q, CPU_BLOCK_K


# No per-element transcendental path, so the prior is read from its table; decode steps
# (fewer than CPU_MIN_QUERIES queries) run blockwise attention, which does not compute whole
# 64-query blocks. Training keeps blockwise attention: the kernel's backward is blockwise.
BACKEND = FusedBackend(
    "cpu",
    choose_blocks,
    table_prior_only=True,
    min_queries=CPU_MIN_QUERIES,
    short_call_block_k=CPU_SHORT_BLOCK_K,
    reads_window_only=True,
    preferred_for_inference=cpu_kernel_preferred,
)
