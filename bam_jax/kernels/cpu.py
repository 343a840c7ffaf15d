"""The CPU forward kernel: bam_jax/kernels/cpu_attention.cc as an XLA FFI custom call.

Pallas has no CPU lowering, so the fused kernel's CPU backend is native code: one task per
(batch row, kv head, up to 8 blocks of CPU_BLOCK_Q queries of every head sharing it) walks
its visible CPU_BLOCK_K-key tiles, each loaded once for all of its query blocks, with the
prior read from the per-head table and the masks and online softmax applied while a tile
is in cache (see the source's header). It is compiled on first use with
the machine's C++ compiler (`$CXX`, else c++, g++ or clang++) for the running CPU
(-march=native) and cached under `$BAM_JAX_KERNEL_CACHE` (default
~/.cache/bam_jax/kernels), keyed by the source, the flags, the compiler, the CPU and the
jax version, so a changed source or another machine gets its own build.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bam_jax.kernels.cpu_sharding import partitioned_by_batch_and_heads
from bam_jax.kernels.tile_math import KernelConfig

CPU_BLOCK_Q = 64
CPU_BLOCK_K = 256
TARGET_NAME = "bam_cpu_attention_forward"
SOURCE = Path(__file__).with_name("cpu_attention.cc")
COMPILERS = ("c++", "g++", "clang++")
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread")


_LOG = logging.getLogger("bam.kernels")


class CpuKernelUnavailable(RuntimeError):
    """The CPU kernel could not be built here (no C++ compiler, or it failed)."""


def cpu_kernel_available() -> bool:
    """Whether the CPU kernel builds (and loads) on this machine; builds it if needed."""
    try:
        _register()
    except CpuKernelUnavailable:
        return False
    return True


def num_threads() -> int:
    """Threads the kernel splits its tasks over: the CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_forward(
    config: KernelConfig,
    q_BxTxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    head_params_HxP: jax.Array,
    log_n_BxT: jax.Array | None,
    q_seg_BxT: jax.Array | None,
    k_seg_BxS: jax.Array | None,
    offset_1: jax.Array,
    prior_table_HxX: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """Output [B, T, H, D] float32 and natural-log log-sum-exp [B, H, T] (+inf for rows
    that see no key). Unpadded inputs; the table is over `prior_table_distances(config)`."""
    _register()
    head_dim = q_BxTxHxD.shape[3]
    placeholder_f32 = jnp.zeros((1, 1), jnp.float32)
    placeholder_i32 = jnp.zeros((1, 1), jnp.int32)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    mask = config.mask
    return partitioned_by_batch_and_heads(_kernel_call)(
        f32(q_BxTxHxD),
        f32(k_BxSxKxD),
        f32(v_BxSxKxD),
        placeholder_f32 if prior_table_HxX is None else f32(prior_table_HxX)[:, ::-1],
        f32(head_params_HxP),
        placeholder_f32 if log_n_BxT is None else f32(log_n_BxT),
        placeholder_i32 if q_seg_BxT is None else i32(q_seg_BxT),
        placeholder_i32 if k_seg_BxS is None else i32(k_seg_BxS),
        i32(offset_1),
        causal=np.int64(mask.causal),
        window=np.int64(-1 if mask.window is None else mask.window),
        kv_len=np.int64(mask.kv_len),
        has_prior=np.int64(prior_table_HxX is not None),
        ssmax=np.int64(config.ssmax),
        prior_inside=np.int64(config.prior_inside),
        segments=np.int64(config.segments),
        table_q_len=np.int64(config.padded_q_len),
        num_threads=np.int64(num_threads()),
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


@functools.cache
def _register() -> None:
    path = _build()
    try:
        library = ctypes.cdll.LoadLibrary(str(path))
    except OSError as error:
        raise CpuKernelUnavailable(
            f"loading the compiled CPU kernel {path} failed: {error}"
        ) from None
    jax.ffi.register_ffi_target(
        TARGET_NAME, jax.ffi.pycapsule(library.BamCpuAttentionForward), platform="cpu"
    )


def _build(extra_flags: tuple[str, ...] = ()) -> Path:
    """The compiled library, from the cache or compiled now (atomically: a concurrent or
    interrupted build never leaves a partial file under the final name)."""
    compiler = _compiler()
    flags = (*_FLAGS, *extra_flags, "-isystem", jax.ffi.include_dir())
    path = _cache_dir() / f"cpu_attention-{_build_key(compiler, flags)}.so"
    if not path.exists():
        _LOG.info("compiling the CPU attention kernel into %s (once per machine)", path)
        error = _compile(compiler, flags, path)
        if error is not None:
            raise CpuKernelUnavailable(f"compiling {SOURCE} with {compiler} failed:\n{error}")
    return path


def _compiler() -> str:
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else list(COMPILERS)
    for name in candidates:
        found = shutil.which(name)
        if found:
            return found
    raise CpuKernelUnavailable(
        f"the CPU attention kernel needs a C++17 compiler and found none of {candidates} "
        "(install g++ or clang++, or set CXX); implementation='blockwise' computes the same "
        "function without it"
    )


def _compile(compiler: str, flags: tuple[str, ...], path: Path) -> str | None:
    """Compiles into `path`; None on success, else the compiler's message."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as work:
        partial = Path(work) / path.name
        result = subprocess.run(
            [compiler, *flags, str(SOURCE), "-o", str(partial)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            return result.stderr[-4000:]
        os.replace(partial, path)
    return None


def _cache_dir() -> Path:
    configured = os.environ.get("BAM_JAX_KERNEL_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "bam_jax" / "kernels"


def _build_key(compiler: str, flags: tuple[str, ...]) -> str:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    parts = (SOURCE.read_bytes().decode(), compiler, version, " ".join(flags), _cpu_identity())
    parts = (*parts, jax.__version__)  # jaxlib is released in step with jax
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _cpu_identity() -> str:
    """The CPU's model and instruction-set flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.startswith(wanted)}))
