"""The commands' persistent compilation cache: a private per-user folder by default, moved or
turned off by flag or environment, refused when other users can write to it."""

import os
import stat
import subprocess
import sys

import jax
import pytest

from bam_jax import compilation_cache
from bam_jax.compilation_cache import CACHE_ENV, use_compilation_cache
from bam_jax.io import private

CACHE_OPTIONS = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_compilation_cache_max_size",
)


@pytest.fixture
def unconfigured_jax(monkeypatch, tmp_path):
    """jax with no compilation cache folder (the suite gives it one), restored afterwards;
    the user's cache folder under tmp_path."""
    saved = {name: getattr(jax.config, name) for name in CACHE_OPTIONS}
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home_cache"))
    monkeypatch.delenv(CACHE_ENV, raising=False)
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


def test_the_default_folder_is_private_and_per_user(unconfigured_jax, tmp_path):
    directory = use_compilation_cache()
    assert directory == tmp_path / "home_cache" / "bam_jax" / "xla"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert jax.config.jax_compilation_cache_dir == str(directory)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    assert jax.config.jax_compilation_cache_max_size == compilation_cache.MAX_CACHE_BYTES


def test_the_environment_moves_it_and_the_flag_wins(unconfigured_jax, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "from_env"))
    assert use_compilation_cache() == tmp_path / "from_env"
    jax.config.update("jax_compilation_cache_dir", None)
    assert use_compilation_cache(str(tmp_path / "from_flag")) == tmp_path / "from_flag"


@pytest.mark.parametrize("setting", ["off", "OFF", "0", "none"])
def test_off_turns_it_off(unconfigured_jax, monkeypatch, setting):
    monkeypatch.setenv(CACHE_ENV, setting)
    assert use_compilation_cache() is None
    assert use_compilation_cache(setting) is None
    assert not jax.config.jax_compilation_cache_dir


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o757])
def test_a_folder_others_can_write_is_refused(unconfigured_jax, tmp_path, monkeypatch, mode):
    monkeypatch.setattr(private, "private_group", lambda gid, uid: False)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(ValueError, match=rf"directory {shared} is writable by .*{CACHE_ENV}"):
        use_compilation_cache(str(shared))
    assert not jax.config.jax_compilation_cache_dir


def test_a_folder_jax_was_given_is_kept(unconfigured_jax, tmp_path):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "users_own"))
    assert use_compilation_cache(str(tmp_path / "ours")) == tmp_path / "users_own"
    assert not (tmp_path / "ours").exists()


def test_bam_train_refuses_a_shared_folder_before_it_builds(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    argv = ["--config=micro", f"--workdir={tmp_path / 'run'}", f"--compilation_cache={shared}"]
    code = "import sys; from bam_train.cli import main; main(['bam-train', *sys.argv[1:]])"
    done = subprocess.run(
        [sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert f"error: compilation cache: directory {shared} is writable by every user" in done.stderr
    assert not (tmp_path / "run").exists()
