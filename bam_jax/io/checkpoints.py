"""Reading a training run's checkpoints without the training code: the saved run config and
the model parameters alone.

A run keeps its checkpoints in `WORKDIR/checkpoints/STEP/`, each with a `state` item (the
training state: step, params, consts, optimizer state), a `data` item (the data iterator
position) and a `config` item (the run config as JSON). `load_params` restores only the
`params` and `consts` subtrees of `state`: no optimizer is built and its moments are never
read, so any optimizer setting in the saved config is irrelevant here.

Orbax keeps no checksum of the values, so a damaged file that still decodes would go
unseen: a `checksums` item (JSON) holds one of every array of `state`, and reading checks
the arrays it restores against it. Checkpoints written without it are read unchecked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from bam_jax.config import ModelConfig
from bam_jax.io.files import run_path
from bam_jax.model import Transformer

CHECKPOINT_DIR = "checkpoints"
CHECKSUMS_ITEM = "checksums"
CHECKSUM_ALGORITHM = "fmix32-sums-v1"
_MAX_REASON_CHARS = 300
# The seeds of the two sums of `array_checksums`.
_CHECKSUM_SEEDS = (0x9E3779B9, 0x7F4A7C15)

PyTree = Any


def checkpoint_dir(workdir: str | os.PathLike) -> str:
    return os.fspath(run_path(workdir) / CHECKPOINT_DIR)


def error_summary(err: BaseException) -> str:
    """One line saying why a checkpoint failed to load. Orbax wraps tensorstore's message
    (which names the file and the damage) in an exception whose own text is a page of spec,
    so the innermost cause is the informative one."""
    seen = {id(err)}
    while (inner := _cause(err)) is not None and id(inner) not in seen:
        err = inner
        seen.add(id(err))
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0] if lines else 'no message'}"
    return text if len(text) <= _MAX_REASON_CHARS else text[: _MAX_REASON_CHARS - 3] + "..."


def _cause(err: BaseException) -> BaseException | None:
    """What `err` was raised from, or during (`raise ... from None` hides the latter)."""
    if err.__cause__ is not None or err.__suppress_context__:
        return err.__cause__
    return err.__context__


def quiet_orphaned_checkpoint_reads() -> None:
    """After a checkpoint fails to load, TensorStore finishes the reads still in flight and
    hands them to Orbax's event loop, which is closed by then, or leaves their failed tasks
    unretrieved, or collects its coroutines unfinished; each would print a traceback after the
    one-line error. Those, and only those, are dropped."""
    default_hook = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        if _is_orbax_coroutine(unraisable.object):
            return
        default_hook(unraisable)

    sys.unraisablehook = hook
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _OrphanedReadReports) for f in asyncio_logger.filters):
        asyncio_logger.addFilter(_OrphanedReadReports())


def _is_orbax_coroutine(obj: Any) -> bool:
    """Whether `obj` is a coroutine of Orbax's, such as a read that a failed (or abandoned)
    restore left behind and that is reported when it is collected."""
    code = getattr(obj, "cr_code", None)
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


class _OrphanedReadReports(logging.Filter):
    """Drops asyncio's report of a failed checkpoint read whose task nobody awaited any more
    (the load already failed and said why in one line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        unretrieved = record.getMessage().startswith("Task exception was never retrieved")
        return not (unretrieved and "orbax" in _traceback_text(record))


def _traceback_text(record: logging.LogRecord) -> str:
    error = record.exc_info[1] if record.exc_info else None
    if error is None:
        return record.getMessage()
    return "".join(traceback.format_exception(error))


class CheckpointReadError(ValueError):
    """A checkpoint's files could not be read; the message names its directory and why."""


@contextlib.contextmanager
def explained_read_errors(step_dir: str) -> Iterator[None]:
    """Any failure inside becomes a one-line CheckpointReadError naming `step_dir`."""
    try:
        yield
    except Exception as err:  # orbax, tensorstore and json raise many types for one cause
        message = f"checkpoint: {step_dir} cannot be read: {error_summary(err)}"
        raise CheckpointReadError(message) from err


@contextlib.contextmanager
def checkpoint_reader(workdir: str | os.PathLike) -> Iterator[ocp.CheckpointManager]:
    """A manager that only reads: it creates no directory."""
    options = ocp.CheckpointManagerOptions(create=False)
    manager = ocp.CheckpointManager(epath.Path(checkpoint_dir(workdir)), options=options)
    try:
        yield manager
    finally:
        manager.close()


def checkpoint_steps(workdir: str | os.PathLike) -> list[int]:
    """Steps of the complete checkpoints of a run, ascending (none: an empty list)."""
    return sorted(ocp.utils.checkpoint_steps(checkpoint_dir(workdir)))


def read_run_config(workdir: str | os.PathLike, step: int | None = None) -> tuple[dict, int]:
    """The run config saved with a checkpoint (the latest when `step` is None), as the JSON
    dict it was written as, and its step."""
    with checkpoint_reader(workdir) as manager:
        step = manager.latest_step() if step is None else step
        if step is None or step not in manager.all_steps():
            raise ValueError(
                f"workdir: no checkpoint{'' if step is None else f' at step {step}'} in "
                f"{checkpoint_dir(workdir)} (steps: {list(manager.all_steps())})"
            )
        with explained_read_errors(os.path.join(checkpoint_dir(workdir), str(step))):
            args = ocp.args.Composite(config=ocp.args.JsonRestore())
            return manager.restore(step, args=args)["config"], step


class ChecksumMismatchError(ValueError):
    """An array read from a checkpoint is not the array that was written."""


def key_path_names(path: tuple) -> tuple[str, ...]:
    """The keys of a pytree path as strings (dict keys, attribute names, list indices)."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def array_checksums(tree: PyTree) -> dict[str, Any]:
    """The checksums item of `tree`: per array, by its path ("params/layers/0/..."), 16 hex
    digits, two sums mod 2**32 over the array's 32-bit words of a hash of the word and its
    position (MurmurHash3's finaliser, one seed per sum). The hash is a bijection of the
    word, so one changed value always changes both sums, and every changed bit changes
    about half the bits of its term, so changes of several values go unseen with odds of
    about 2**-64. Computed on the devices holding the array, in integers, so the sharding
    never changes the result."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    sums = jax.device_get(_checksum_sums([leaf for _, leaf in flat]))
    arrays = {
        "/".join(key_path_names(path)): f"{int(a):08x}{int(b):08x}"
        for (path, _), (a, b) in zip(flat, sums, strict=True)
    }
    return {"algorithm": CHECKSUM_ALGORITHM, "arrays": arrays}


@jax.jit
def _checksum_sums(leaves: list[jax.Array]) -> list[tuple[jax.Array, ...]]:
    # Scalars only: a 0-d result is replicated, so every process can read it.
    return [_hashed_sums(_as_words(x)) for x in leaves]


def _as_words(x: jax.Array) -> jax.Array:
    """The bits of `x` as uint32 words (a trailing axis for 64-bit values)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if x.dtype.itemsize < 4:
        narrow = jnp.uint8 if x.dtype.itemsize == 1 else jnp.uint16
        return jax.lax.bitcast_convert_type(x, narrow).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _hashed_sums(words: jax.Array) -> tuple[jax.Array, ...]:
    position = jnp.zeros(words.shape, jnp.uint32)
    for axis in range(words.ndim):  # the flat index, without reshaping a sharded array
        stride = math.prod(words.shape[axis + 1 :])
        iota = jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
        position = position + iota * jnp.uint32(stride % 2**32)
    return tuple(
        jnp.sum(_fmix32(words + _fmix32(position ^ jnp.uint32(seed))), dtype=jnp.uint32)
        for seed in _CHECKSUM_SEEDS
    )


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: a bijection of uint32 in which every input bit flips
    about half the output bits."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def verify_checksums(tree: PyTree, saved: dict[str, Any]) -> None:
    """ChecksumMismatchError naming the first array of `tree` whose checksum differs from
    the one in the checksums item `saved` (arrays it does not list are not checked)."""
    if saved.get("algorithm") != CHECKSUM_ALGORITHM:
        raise ChecksumMismatchError(
            f"its checksums use {saved.get('algorithm')!r}, which this version cannot check"
        )
    expected = saved["arrays"]
    for path, checksum in array_checksums(tree)["arrays"].items():
        if path in expected and expected[path] != checksum:
            raise ChecksumMismatchError(
                f"{path} differs from the checksum saved with it (the file changed after it "
                "was written)"
            )


def read_checksums(
    manager: ocp.CheckpointManager, step: int, step_dir: str | os.PathLike
) -> dict[str, Any] | None:
    """The checksums item of checkpoint `step` in `step_dir`, None when it has none."""
    if not (epath.Path(step_dir) / CHECKSUMS_ITEM).exists():
        return None
    args = ocp.args.Composite(**{CHECKSUMS_ITEM: ocp.args.JsonRestore()})
    return manager.restore(step, args=args)[CHECKSUMS_ITEM]


@dataclasses.dataclass(frozen=True)
class SavedParams:
    """The parameters of one checkpoint and what they belong to.

    params / consts: nested dicts of arrays (trainable parameters and the other variables),
    as the training state holds them; run_config: the saved run config (a JSON dict).
    """

    config: ModelConfig
    step: int
    params: PyTree
    consts: PyTree
    run_config: dict

    def model(self) -> Transformer:
        """A Transformer holding these parameters."""
        graphdef, params, consts = _abstract_split(self.config)
        nnx.replace_by_pure_dict(params, self.params)
        nnx.replace_by_pure_dict(consts, self.consts)
        return nnx.merge(graphdef, params, consts)


def _abstract_split(config: ModelConfig) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    return nnx.split(abstract, nnx.Param, ...)


def load_params(workdir: str | os.PathLike, step: int | None = None) -> SavedParams:
    """The model parameters of a run's checkpoint (latest when `step` is None), on one device.

    Only the `params` and `consts` subtrees of the saved state are read. A checkpoint that
    cannot be read is a CheckpointReadError naming its directory and the cause.
    """
    run_config, step = read_run_config(workdir, step)
    config = ModelConfig.from_dict(run_config["model"])
    _, params, consts = _abstract_split(config)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        {"params": nnx.to_pure_dict(params), "consts": nnx.to_pure_dict(consts)},
    )
    restore = ocp.args.PyTreeRestore(
        item=target,
        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True,
    )
    args = ocp.args.Composite(state=restore)
    step_dir = os.path.join(checkpoint_dir(workdir), str(step))
    with checkpoint_reader(workdir) as manager, explained_read_errors(step_dir):
        state = manager.restore(step, args=args)["state"]
        checksums = read_checksums(manager, step, step_dir)
        if checksums is not None:
            verify_checksums(state, checksums)
    return SavedParams(config, step, state["params"], state["consts"], run_config)


def load_model(
    workdir: str | os.PathLike, step: int | None = None
) -> tuple[ModelConfig, Transformer]:
    """The model of a run's checkpoint (latest when `step` is None), on one device."""
    saved = load_params(workdir, step)
    return saved.config, saved.model()
