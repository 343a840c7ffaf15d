"""Damage to a saved checkpoint that still decodes, for the tests of what reads it."""

import shutil
from collections.abc import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp


def rewrite_floats(step_dir: str, change: Callable[[np.ndarray], np.ndarray]) -> None:
    """The `state` item of a checkpoint written again with `change` applied to its
    floating-point arrays; the checkpoint's other items stay as they were."""
    checkpointer = ocp.StandardCheckpointer()
    state = checkpointer.restore(f"{step_dir}/state")
    state = jax.tree.map(lambda x: change(x) if np.issubdtype(x.dtype, np.floating) else x, state)
    shutil.rmtree(f"{step_dir}/state")
    checkpointer.save(f"{step_dir}/state", state)
    checkpointer.wait_until_finished()
    checkpointer.close()


def shift_floats(step_dir: str) -> None:
    """Every floating-point value moved by 1e-3: still finite, only a checksum tells."""
    rewrite_floats(step_dir, lambda x: x + np.asarray(1e-3, x.dtype))
