"""Fixtures shared by the tests."""

import os
import shutil
import tempfile

import jax
import pytest

from tests.support import suite_xla_flags

pytest_plugins = ("tests.support.compile_report",)

_OWNED_CACHES = pytest.StashKey[list[str]]()


def pytest_configure(config: pytest.Config) -> None:
    """Many tests compile the same programs (one model, one train step) and the CPU
    kernel: every test, xdist worker and subprocess of the session shares one persistent
    compilation cache and one kernel cache, never the user's. The controller makes them
    before the workers start, and they inherit them with the environment, as they do the
    suite's compiler flags (`suite_xla_flags`), which jax reads when its backend starts."""
    owned = []
    for variable, prefix in (
        ("JAX_COMPILATION_CACHE_DIR", "bam_jax_xla_cache_"),
        ("BAM_JAX_KERNEL_CACHE", "bam_jax_kernel_cache_"),
    ):
        if variable not in os.environ:
            os.environ[variable] = tempfile.mkdtemp(prefix=prefix)
            owned.append(os.environ[variable])
    config.stash[_OWNED_CACHES] = owned
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {suite_xla_flags()}".strip()
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs",
        float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
    )
    jax.config.update(
        "jax_persistent_cache_min_entry_size_bytes",
        int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]),
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    for directory in config.stash.get(_OWNED_CACHES, []):
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> str:
    """A reference run directory (model.npz, args.json) of an untrained nano bam_ssmax model
    over bytes, context 64."""
    from flax import nnx

    from bam_jax.config import ModelConfig
    from bam_jax.model import Transformer
    from bam_jax.reference_checkpoint import export_reference_checkpoint

    config = ModelConfig.of_size("nano", vocab_size=259, encoding="bam_ssmax", max_seq_len=64)
    path = tmp_path_factory.mktemp("runs") / "bam"
    export_reference_checkpoint(Transformer(config, rngs=nnx.Rngs(0)), config, path, fmt="npz")
    return str(path)
