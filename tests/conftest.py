"""Fixtures shared by the tests."""

import os
import shutil
import tempfile

import jax
import pytest

_OWNED_CACHE = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """Many tests compile the same programs (one model, one train step): every test, xdist
    worker and subprocess of the session shares one persistent compilation cache. The
    controller makes it before the workers start, and they inherit it with the
    environment."""
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="bam_jax_xla_cache_")
        config.stash[_OWNED_CACHE] = os.environ["JAX_COMPILATION_CACHE_DIR"]
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
    owned = config.stash.get(_OWNED_CACHE, None)
    if owned is not None:
        shutil.rmtree(owned, ignore_errors=True)


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
