"""jax's persistent compilation cache for the commands: a second run of the same training or
evaluation reads its compiled programs back instead of compiling them again (a job
restarted after preemption, a sweep run twice, an evaluation repeated on a new checkpoint).

`use_compilation_cache` turns it on for the process, in `$BAM_JAX_COMPILATION_CACHE`
(default `$XDG_CACHE_HOME/bam_jax/xla`, else `~/.cache/bam_jax/xla`); "off" turns it off. A
folder another user can write is refused, since the programs read from it run as compiled
code. It holds at most 4 GiB, dropping the least recently used programs. A folder that jax
was already given (`JAX_COMPILATION_CACHE_DIR`, or
`jax.config.update("jax_compilation_cache_dir", ...)`) is left as it is.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import jax

from bam_jax.io.private import NotPrivateError, make_private_directory, user_cache_dir

CACHE_ENV = "BAM_JAX_COMPILATION_CACHE"
OFF_VALUES = ("off", "none", "0", "false", "no")
# Every program is cached: a command's many small programs (the evaluation's, above all)
# together take seconds to compile. The least recently used are dropped above the size limit.
MIN_COMPILE_SECONDS = 0.0
MAX_CACHE_BYTES = 4 * 2**30
FLAG_HELP = (
    f"folder of compiled programs kept between runs (default ${CACHE_ENV}, else "
    "~/.cache/bam_jax/xla); off: compile every program anew"
)


def add_compilation_cache_argument(parser: argparse.ArgumentParser) -> None:
    """`--compilation-cache DIR` (or off) for a command's parser."""
    parser.add_argument(
        "--compilation-cache",
        default=None,
        metavar="DIR",
        help=FLAG_HELP,
    )


def use_compilation_cache(setting: str | None = None) -> Path | None:
    """Turn on the persistent compilation cache; returns its folder (None when off).

    `setting` is a folder or "off"; None takes `$BAM_JAX_COMPILATION_CACHE`, then the
    default folder. Raises ValueError, naming the folder, when another user can write to it
    or it cannot be created."""
    configured = jax.config.jax_compilation_cache_dir
    if configured:
        return Path(configured)
    chosen = setting if setting is not None else os.environ.get(CACHE_ENV, "")
    if chosen.strip().lower() in OFF_VALUES:
        return None
    directory = Path(chosen).expanduser() if chosen.strip() else user_cache_dir("xla")
    _check_directory(directory)
    jax.config.update("jax_compilation_cache_dir", os.fspath(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_compilation_cache_max_size", MAX_CACHE_BYTES)
    return directory


def _check_directory(directory: Path) -> None:
    try:
        make_private_directory(directory)
    except NotPrivateError as err:
        raise ValueError(
            f"compilation cache: {err}, so another user could replace the programs it holds; "
            f"remove other users' write access (chmod go-w {err.path}), or set "
            f"{CACHE_ENV} to a folder of your own (or to 'off')"
        ) from None
    except OSError as err:
        raise ValueError(
            f"compilation cache: cannot create {directory}: {err.strerror or err}; set "
            f"{CACHE_ENV} to a writable folder (or to 'off')"
        ) from None
