"""Fixtures shared by the training tests."""

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
