"""Fixtures shared by the tests."""

import jax
import pytest


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
    """Runs of one config compile the same programs: let a module's runs share a persistent
    cache (`pytestmark = pytest.mark.usefixtures("compilation_cache")`)."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    previous = {name: getattr(jax.config, name) for name in names}
    values = (str(tmp_path_factory.mktemp("xla_cache")), 0, -1)
    for name, value in zip(names, values, strict=True):
        jax.config.update(name, value)
    cc.reset_cache()
    yield
    for name, value in previous.items():
        jax.config.update(name, value)
    cc.reset_cache()


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
