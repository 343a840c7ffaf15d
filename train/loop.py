"""The training loop: a jitted step over a device mesh, checkpoints, resume, metrics.

The step is `nnx.merge` -> `jax.value_and_grad` -> optax inside one `jax.jit`, with the
state's shardings as input and output shardings and the state donated. Gradients of the
`accum_steps` micro-batches are summed by a scan, so one call is one optimizer step; the
loss is the mean over all trained target tokens of the global batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from bam_jax.io.checkpoints import (
    CheckpointReadError,
    checkpoint_dir,
    error_summary,
    explained_read_errors,
)
from bam_jax.io.files import is_url, run_path, write_text_atomically
from bam_jax.model import LayerFactors, count_params
from bam_train.checkpoint import Checkpointer, full_disk_stops_the_run, readable_size
from bam_train.config import TrainConfig, validate_for_runtime
from bam_train.data import BatchLayout, loss_positions_per_row, train_iterator, val_batches
from bam_train.metrics import MetricsWriter, device_peak_flops, train_flops_per_token
from bam_train.optim import learning_rates, make_optimizer
from bam_train.sharding import batch_sharding, local_rows, make_mesh, replicated
from bam_train.state import ModelParts, TrainState, init_state, state_shardings

Batch = dict[str, Any]
# Folded into the seed's key for the SSMax jitter and prior dilation draws, apart from every
# other use of it.
SSMAX_JITTER_STREAM = 0x55AA
PRIOR_DILATION_STREAM = 0x5A5A
# The exit status of a run stopped by Ctrl-C: 128 + SIGINT, what shells report for it.
INTERRUPTED_STATUS = 130


class NonFiniteLossError(RuntimeError):
    """The loss, the gradient norm or the updated state became NaN or infinite."""


def loss_sums(
    parts: ModelParts, params, consts, batch: Batch, factors: LayerFactors | None = None
) -> tuple[jax.Array, jax.Array]:
    """Summed cross-entropy over trained targets of a [batch, seq_len] micro-batch, and the
    number of trained targets.

    With `loss_positions` [batch, P] in the batch (rows trained on P known positions, such as
    passkey answers) only those P positions go through the output projection.
    `factors` are the step's per-layer SSMax scale factors and prior dilations
    (`layer_factors`).
    """
    model = parts.merge(params, consts)
    hidden_BxPxE = model.hidden_states(
        batch["inputs"], segment_ids_BxT=batch["segment_ids"], layer_factors=factors
    )
    targets_BxP, mask_BxP = batch["targets"], batch["loss_mask"]
    if "loss_positions" in batch:
        positions_BxP = batch["loss_positions"]
        hidden_BxPxE = jnp.take_along_axis(hidden_BxPxE, positions_BxP[..., None], axis=1)
        targets_BxP = jnp.take_along_axis(targets_BxP, positions_BxP, axis=1)
        mask_BxP = jnp.take_along_axis(mask_BxP, positions_BxP, axis=1)
    return model.cross_entropy_sum(hidden_BxPxE, targets_BxP, mask_BxP), jnp.sum(mask_BxP)


def layer_factors(cfg: TrainConfig, step: jax.Array, micro_batches: int) -> LayerFactors | None:
    """The per-layer factors of optimizer step `step`, each [micro_batches, n_layers] (None
    when the run draws neither), from the run's seed and the step:
    - `ssmax_scale_L` (with `ssmax_jitter`): one draw from U[1 - ssmax_jitter, 1] per
      micro-batch, shared by the layers whose key count grows with the prompt
      (`ModelConfig.ssmax_growing_layers`); 1 for the capped and windowed layers, whose key
      count stays the training one at any length.
    - `prior_dilation_L` (with `prior_dilation` > 1): one draw of exp(U[0, log
      prior_dilation]) per micro-batch, shared by the global layers; 1 for the windowed
      ones, which never see a distance beyond their window."""
    ssmax_AxL = _ssmax_jitter_factors(cfg, step, micro_batches) if cfg.ssmax_jitter else None
    dilation_AxL = _prior_dilations(cfg, step, micro_batches) if cfg.prior_dilation > 1 else None
    if ssmax_AxL is None and dilation_AxL is None:
        return None
    return LayerFactors(ssmax_scale_L=ssmax_AxL, prior_dilation_L=dilation_AxL)


def _uniform_draws(cfg: TrainConfig, stream: int, step: jax.Array, count: int) -> jax.Array:
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(cfg.seed), stream), step)
    return jax.random.uniform(key, (count,), dtype=jnp.float32)


def _ssmax_jitter_factors(cfg: TrainConfig, step: jax.Array, micro_batches: int) -> jax.Array:
    draws_A = _uniform_draws(cfg, SSMAX_JITTER_STREAM, step, micro_batches)
    factors_Ax1 = (1.0 - cfg.ssmax_jitter * draws_A)[:, None]
    growing_L = jnp.asarray(cfg.model.ssmax_growing_layers())
    return jnp.where(growing_L[None, :], factors_Ax1, 1.0)


def _prior_dilations(cfg: TrainConfig, step: jax.Array, micro_batches: int) -> jax.Array:
    draws_A = _uniform_draws(cfg, PRIOR_DILATION_STREAM, step, micro_batches)
    dilations_Ax1 = jnp.exp(math.log(cfg.prior_dilation) * draws_A)[:, None]
    global_L = jnp.asarray(cfg.model.global_layers())
    return jnp.where(global_L[None, :], dilations_Ax1, 1.0)


def make_train_step(
    parts: ModelParts, tx: optax.GradientTransformation, cfg: TrainConfig
) -> Callable:
    grad_fn = jax.value_and_grad(
        lambda p, c, b, f: loss_sums(parts, p, c, b, f), has_aux=True, argnums=0
    )

    def step(state: TrainState, batch_AxBxT: Batch) -> tuple[TrainState, dict]:
        micro_batches = batch_AxBxT["inputs"].shape[0]
        factors = layer_factors(cfg, state.step, micro_batches)

        def micro(carry, batch_and_factors):
            loss_sum, count, grads = carry
            (loss, n), g = grad_fn(state.params, state.consts, *batch_and_factors)
            return (loss_sum + loss, count + n, jax.tree.map(jnp.add, grads, g)), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros)
        (loss_sum, count, grads), _ = jax.lax.scan(micro, init, (batch_AxBxT, factors))
        denom = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss_sum / denom,
            "grad_norm": optax.tree.norm(grads),
            "trained_tokens": count,
            "state_finite": _all_finite((params, opt_state)),
        }
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    return step


def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def make_eval_step(parts: ModelParts) -> Callable:
    def evaluate(params, consts, batch_AxBxT: Batch) -> tuple[jax.Array, jax.Array]:
        def micro(carry, batch_BxT):
            loss, n = loss_sums(parts, params, consts, batch_BxT)
            return (carry[0] + loss, carry[1] + n), None

        zero = jnp.zeros((), jnp.float32)
        (loss_sum, count), _ = jax.lax.scan(micro, (zero, zero), batch_AxBxT)
        return loss_sum, count

    return evaluate


@dataclasses.dataclass
class Setup:
    """Everything a run needs before it touches data or parameters."""

    cfg: TrainConfig
    mesh: Mesh
    parts: ModelParts
    tx: optax.GradientTransformation
    abstract_state: TrainState
    shardings: TrainState
    batch_sharding: NamedSharding
    train_step: Callable
    eval_step: Callable
    init: Callable

    @property
    def global_batch_shape(self) -> tuple[int, int, int]:
        return (self.cfg.accum_steps, self.cfg.batch_size, self.cfg.seq_len)

    def layout(self) -> BatchLayout:
        start, count = local_rows(self.batch_sharding, self.global_batch_shape)
        return BatchLayout(self.cfg.accum_steps, self.cfg.batch_size, start, count)

    def global_batch(self, local: Batch) -> Batch:
        """Device arrays of this process's [micro-batches, local rows, ...] arrays."""
        batch = self.cfg.batch_size
        return {
            k: jax.make_array_from_process_local_data(
                self.batch_sharding, np.asarray(v), (np.shape(v)[0], batch, *np.shape(v)[2:])
            )
            for k, v in local.items()
        }

    def abstract_batch(self) -> Batch:
        shape, sharding = self.global_batch_shape, self.batch_sharding
        batch = {
            k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
            for k in ("inputs", "targets", "segment_ids", "positions")
        }
        batch["loss_mask"] = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)
        scored = loss_positions_per_row(self.cfg.data)
        if scored is not None:
            batch["loss_positions"] = jax.ShapeDtypeStruct(
                (*shape[:2], scored), jnp.int32, sharding=sharding
            )
        return batch

    def abstract_sharded_state(self) -> TrainState:
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            self.abstract_state,
            self.shardings,
        )


def build(cfg: TrainConfig, devices: list[jax.Device] | None = None) -> Setup:
    """Validate against the runtime, then build mesh, optimizer, shardings and jitted steps
    (on `devices`, default all)."""
    devices = jax.devices() if devices is None else devices
    validate_for_runtime(cfg, len(devices), jax.process_count())
    mesh = make_mesh(cfg.mesh, devices)
    parts, _, _ = ModelParts.from_config(cfg.model)
    tx = make_optimizer(cfg.optim, cfg.steps, parts.labels)
    init_fn = functools.partial(init_state, cfg.model, parts, tx, cfg.seed)
    abstract_state = jax.eval_shape(init_fn)
    shardings = state_shardings(parts, abstract_state, tx, mesh)
    b_sharding = batch_sharding(mesh)
    rep = replicated(mesh)
    train_step = jax.jit(
        make_train_step(parts, tx, cfg),
        in_shardings=(shardings, b_sharding),
        out_shardings=(shardings, rep),
        donate_argnums=0,
    )
    eval_step = jax.jit(
        make_eval_step(parts),
        in_shardings=(shardings.params, shardings.consts, b_sharding),
        out_shardings=rep,
    )
    init = jax.jit(init_fn, out_shardings=shardings)
    return Setup(
        cfg, mesh, parts, tx, abstract_state, shardings, b_sharding, train_step, eval_step, init
    )


def validation_set(setup: Setup, layout: BatchLayout) -> Batch | None:
    """The validation micro-batches as one global batch that the eval step scans over, put
    on the devices once for the whole run; None when `eval_every` is 0."""
    cfg = setup.cfg
    if not cfg.eval_every:
        return None
    batches = val_batches(cfg.data, cfg.seq_len, cfg.seed, layout, cfg.eval_batches)
    return setup.global_batch({k: np.concatenate([b[k] for b in batches]) for k in batches[0]})


MEMORY_ADVICE = "raise mesh.fsdp, lower batch_size (more accumulation steps) or set model.remat"


def dry_run(setup: Setup) -> dict[str, Any]:
    """A full preflight: build what a real start builds and fail, with a ValueError, on what
    would fail at step 1, without allocating the training state.

    Reads the first training batch and the validation set, lowers and compiles the train
    step and the eval step for the abstract sharded state and those batches, and compares
    the memory one device needs at its peak with the device's memory where that is known
    (accelerators; not the CPU).
    """
    cfg = setup.cfg
    layout = setup.layout()
    data = train_iterator(cfg.data, cfg.seq_len, cfg.seed, layout)
    train_batch = setup.global_batch(next(data))
    val = validation_set(setup, layout)
    state = setup.abstract_sharded_state()
    train_compiled, train_s = _compile("train step", setup.train_step, state, train_batch)
    report: dict[str, Any] = {
        "params": count_params(setup.abstract_state.params),
        "mesh": dict(setup.mesh.shape),
        "devices": jax.device_count(),
        "accum_steps": cfg.accum_steps,
        "train_batch": _shape(train_batch),
        "compile_s": train_s,
        "per_device_bytes": _memory(train_compiled),
    }
    peaks = [_plus(report["per_device_bytes"], _bytes_per_device(val))]
    if val is not None:
        eval_compiled, eval_s = _compile(
            "eval step", setup.eval_step, state.params, state.consts, val
        )
        report["validation_batch"] = _shape(val)
        report["eval_compile_s"] = eval_s
        report["eval_per_device_bytes"] = _memory(eval_compiled)
        peaks.append(_plus(report["eval_per_device_bytes"], _bytes_per_device(state.opt_state)))
    report["peak_bytes"] = None if None in peaks else max(peaks)
    report["device_bytes"] = device_memory_bytes()
    _check_fits(report)
    return report


def _compile(name: str, jitted: Callable, *args) -> tuple[Any, float]:
    """The compiled program and its compile time; running out of memory while compiling is
    a ValueError."""
    start = time.perf_counter()
    try:
        compiled = jitted.lower(*args).compile()
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        first_line = str(err).strip().splitlines()[0]
        raise ValueError(
            f"memory: the {name} does not fit on a device ({first_line}); {MEMORY_ADVICE}"
        ) from None
    return compiled, round(time.perf_counter() - start, 2)


def _shape(batch: Batch) -> tuple[int, ...]:
    return tuple(batch["inputs"].shape)


def _memory(compiled: Any) -> dict[str, int] | None:
    """Bytes per device of a compiled program (None where the backend does not say)."""
    memory = compiled.memory_analysis()
    if memory is None:
        return None
    fields = ("argument", "output", "temp", "alias", "generated_code")
    per_device = {f: int(getattr(memory, f"{f}_size_in_bytes", 0)) for f in fields}
    per_device["total"] = (
        per_device["argument"] + per_device["output"] + per_device["temp"] - per_device["alias"]
    )
    return per_device


def _plus(per_device: dict[str, int] | None, resident: int) -> int | None:
    """A program's total bytes per device plus `resident` bytes held beside it."""
    return None if per_device is None else per_device["total"] + resident


def _bytes_per_device(tree: Any) -> int:
    """Bytes of one device's shard of every (abstract or concrete) sharded array in `tree`."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )


def device_memory_bytes() -> int | None:
    """Memory of one local device, where the backend reports it (accelerators, not CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def _check_fits(report: dict[str, Any]) -> None:
    """The peak of a device: the train step plus the validation set it keeps, or the eval
    step plus the optimizer state, which stays in memory while it runs."""
    peak, limit = report["peak_bytes"], report["device_bytes"]
    if peak is not None and limit is not None and peak > limit:
        raise ValueError(
            f"memory: one device needs {readable_size(peak)} at its peak (train step "
            f"{readable_size(report['per_device_bytes']['total'])}), a "
            f"{jax.devices()[0].device_kind} has {readable_size(limit)}; {MEMORY_ADVICE}"
        )


def format_dry_run(report: dict[str, Any]) -> str:
    lines = [
        f"parameters: {report['params']:,}",
        f"mesh: {report['mesh']} on {report['devices']} devices, "
        f"{report['accum_steps']} micro-batches per step",
        f"train batch: {report['train_batch']}, compile time: {report['compile_s']} s",
    ]
    if "validation_batch" in report:
        lines.append(
            f"validation set: {report['validation_batch']}, "
            f"eval step compile time: {report['eval_compile_s']} s"
        )
    for name, value in (report.get("per_device_bytes") or {}).items():
        lines.append(f"per-device {name}: {value / 2**20:,.1f} MiB")
    if report.get("eval_per_device_bytes"):
        eval_total = report["eval_per_device_bytes"]["total"]
        lines.append(f"per-device eval step total: {eval_total / 2**20:,.1f} MiB")
    lines.append(_fit_line(report["peak_bytes"], report["device_bytes"]))
    return "\n".join(lines)


def _fit_line(peak: int | None, limit: int | None) -> str:
    if peak is None:
        return "per-device peak: not reported by this backend"
    if limit is None:
        return (
            f"per-device peak: {readable_size(peak)}; device memory unknown (not reported by "
            "the backend)"
        )
    return f"per-device peak: {readable_size(peak)} of {readable_size(limit)} device memory: fits"


@dataclasses.dataclass
class TrainResult:
    step: int
    state: TrainState
    last_loss: float | None
    preempted: bool = False  # stopped by SIGTERM, the current step saved
    interrupted: bool = False  # stopped by Ctrl-C (SIGINT), the current step saved


class _StopRequests:
    """SIGTERM and a first SIGINT (Ctrl-C) as a request the loop checks after each step; a
    second SIGINT kills the process at once (its default action), saving nothing.

    One process: Python signal handlers (main thread only; a SIGINT that was ignored when
    the run started stays ignored). Several processes: JAX's preemption service (started
    by `jax.distributed.initialize`) tells every process of a SIGTERM, and all of them stop
    at the same step; SIGINT keeps its KeyboardInterrupt there, since one process cannot
    save alone.
    """

    def __init__(self):
        self._signal_name: str | None = None
        self._previous: dict[int, Any] = {}
        self._multi_process = jax.process_count() > 1

    def __enter__(self):
        if self._multi_process or not _in_main_thread():
            return self
        self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._terminate)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)
        return self

    def _terminate(self, signum, frame):
        self._signal_name = self._signal_name or "SIGTERM"

    def _interrupt(self, signum, frame):
        self._signal_name = self._signal_name or "SIGINT"
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    def requested(self, step: int) -> str | None:
        """The signal that asks the run to save and stop ("SIGTERM", "SIGINT"), or None."""
        if self._multi_process:
            return "SIGTERM" if multihost_utils.reached_preemption_sync_point(step) else None
        return self._signal_name

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def train(cfg: TrainConfig, workdir: str, *, stop_after: int | None = None) -> TrainResult:
    """Train to `cfg.steps` (or stop after `stop_after` steps, saving), resuming from the
    newest checkpoint in `workdir` that restores (see `_resume`). A full disk stops the run
    with a `DiskFullError`."""
    workdir = _prepare_workdir(workdir)
    with full_disk_stops_the_run(workdir):
        return _train(cfg, workdir, stop_after)


def _train(cfg: TrainConfig, workdir: str, stop_after: int | None) -> TrainResult:
    setup = build(cfg)
    layout = setup.layout()
    data = train_iterator(cfg.data, cfg.seq_len, cfg.seed, layout)
    val = validation_set(setup, layout)
    with contextlib.closing(Checkpointer(workdir, cfg)) as checkpointer:
        state, start, notes = _resume(setup, checkpointer, data, workdir)
        if jax.process_index() == 0:
            config_json = json.dumps(cfg.to_dict(), indent=2)
            write_text_atomically(run_path(workdir) / "config.json", config_json)
        writer = MetricsWriter(
            workdir, total_steps=cfg.steps, start_step=start, progress_bar=cfg.progress_bar
        )
        with contextlib.closing(writer):
            writer.print(run_summary(setup, workdir))
            for note in notes:
                writer.print(note)
            if start:
                writer.print(f"resumed from step {start} in {workdir}")
            run = _Run(setup, workdir, data, val, checkpointer, writer)
            end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
            with _StopRequests() as stop_requests:
                return run.loop(state, start, end, stop_requests)


def run_summary(setup: Setup, workdir: str) -> str:
    """What a run is about to do, in a few lines: devices and mesh, model, data, output."""
    cfg, model = setup.cfg, setup.cfg.model
    mesh = " x ".join(f"{name} {size}" for name, size in setup.mesh.shape.items())
    devices = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    precision = "float32" if model.dtype == "float32" else f"{model.dtype} matmuls"
    n_params = count_params(setup.abstract_state.params)
    tokens = cfg.accum_steps * cfg.batch_size * cfg.seq_len
    rows = f"{cfg.accum_steps} x {cfg.batch_size} rows x {cfg.seq_len}"
    data = cfg.data.source + (f" {cfg.data.path}" if cfg.data.path else "")
    return "\n".join(
        [
            f"devices: {devices} in {jax.process_count()} process(es); mesh {mesh}",
            f"model: {model.encoding}, {n_params:,} parameters, {precision}",
            f"steps: {cfg.steps} of {tokens:,} tokens ({rows})",
            f"data: {data}, tokenizer {cfg.data.tokenizer}; workdir: {workdir}",
        ]
    )


def _prepare_workdir(workdir: str) -> str:
    """The run directory as every writer takes it (URLs untouched, local paths absolute),
    created if local; a ValueError says what is wrong with it."""
    path = run_path(workdir)
    if is_url(path):
        _check_remote_workdir(path)
        return os.fspath(path)
    local = os.fspath(path)
    for directory in (local, checkpoint_dir(local)):
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"workdir: {directory!r} is a file, expected a directory")
    try:
        os.makedirs(local, exist_ok=True)
    except OSError as err:
        raise ValueError(f"workdir: cannot create {local!r}: {err.strerror or err}") from None
    if not os.access(local, os.W_OK | os.X_OK):
        raise ValueError(f"workdir: {local!r} is not writable")
    return local


def _check_remote_workdir(path: epath.Path) -> None:
    """One look at a URL workdir, so that a missing client library or an unreachable bucket
    stops the run before it builds anything; writing is left to the first write."""
    try:
        is_file = path.exists() and not path.is_dir()
    except ImportError as err:
        raise ValueError(f"workdir: {os.fspath(path)!r} needs a client library: {err}") from None
    except Exception as err:  # each storage client raises its own types
        raise ValueError(
            f"workdir: cannot reach {os.fspath(path)!r}: {error_summary(err)}"
        ) from None
    if is_file:
        raise ValueError(f"workdir: {os.fspath(path)!r} is a file, expected a directory")


def _resume(
    setup: Setup, checkpointer: Checkpointer, data: Any, workdir: str
) -> tuple[TrainState, int, list[str]]:
    """The state of the newest checkpoint that restores, its step and notes for the user
    (a fresh state at step 0 when there is no checkpoint); `data` is set to the position
    saved with it.

    Newer checkpoints that fail to restore are moved aside to `checkpoints/STEP.broken`,
    never deleted, so the run trains and saves their steps again; the notes say which were
    moved and why. When none restores nothing is moved and a ValueError lists them all.
    """
    failures: list[tuple[int, str]] = []
    for step in sorted(checkpointer.steps(), reverse=True):
        try:
            state = _restore(setup, checkpointer, step, data, workdir)
        except CheckpointReadError as err:
            failures.append((step, str(err)))
            continue
        notes = [
            f"{why}; moved it to {checkpointer.set_aside(broken, 'broken')} and resumed "
            f"from step {step}"
            for broken, why in failures
        ]
        return state, step, notes
    if failures:
        raise ValueError(
            f"workdir: no checkpoint in {checkpointer.directory} can be restored "
            f"({'; '.join(why for _, why in failures)}); move them out of "
            f"{checkpointer.directory} to train from step 0"
        )
    return setup.init(), 0, []


def _restore(
    setup: Setup, checkpointer: Checkpointer, step: int, data: Any, workdir: str
) -> TrainState:
    saved = checkpointer.read_config(step)
    _check_same_model(setup.cfg, saved, workdir)
    state, data_state = checkpointer.restore(step, _abstract_as_saved(setup, saved))
    if not bool(jax.jit(_all_finite)(state)):
        raise CheckpointReadError(
            f"checkpoint: {checkpointer.step_dir(step)} cannot be read: it holds NaN or "
            "infinite values (a damaged file that still decodes)"
        )
    with explained_read_errors(checkpointer.step_dir(step)):
        data.set_state(data_state)
    opt_leaves = jax.tree.leaves(state.opt_state)
    opt_treedef = jax.tree.structure(setup.abstract_state.opt_state)
    return state.replace(opt_state=jax.tree.unflatten(opt_treedef, opt_leaves))


def _check_same_model(cfg: TrainConfig, saved: TrainConfig, workdir: str) -> None:
    """Resuming needs the model of the checkpoint; other fields (steps, lr, ...) may change."""
    if saved.model != cfg.model:
        old, new = saved.model.to_dict(), cfg.model.to_dict()
        changed = {k: (old[k], new[k]) for k in new if old[k] != new[k]}
        raise ValueError(
            f"workdir: {workdir!r} holds checkpoints of another model (changed model fields, "
            f"saved -> requested: {changed}); use a new workdir"
        )


def _abstract_as_saved(setup: Setup, saved: TrainConfig) -> TrainState:
    """The sharded abstract state in the tree structure of a checkpoint written with config
    `saved`. Turning `optim.clip_norm` or `optim.weight_decay` on or off adds or removes
    optimizer stages that hold no arrays: the arrays, and their order, stay the same."""
    abstract = setup.abstract_sharded_state()
    if saved.optim == setup.cfg.optim:
        return abstract
    saved_tx = make_optimizer(saved.optim, saved.steps, setup.parts.labels)
    saved_treedef = jax.tree.structure(jax.eval_shape(saved_tx.init, setup.abstract_state.params))
    leaves = jax.tree.leaves(abstract.opt_state)
    if saved_treedef.num_leaves != len(leaves):
        old, new = dataclasses.asdict(saved.optim), dataclasses.asdict(setup.cfg.optim)
        changed = {k: (old[k], new[k]) for k in new if old[k] != new[k]}
        raise ValueError(
            f"optim: the optimizer state in the checkpoints does not fit the requested "
            f"optimizer (changed optim fields, saved -> requested: {changed}); restore "
            f"those values or use a new workdir"
        )
    return abstract.replace(opt_state=jax.tree.unflatten(saved_treedef, leaves))


@dataclasses.dataclass
class _Run:
    """The loop of one `train` call and the bookkeeping around each step.

    Steps are dispatched without waiting for the device: their metrics stay on the device
    until a step that logs, validates, checkpoints or ends the run, where all of them are
    read back at once and checked in order. A non-finite step is so found at most
    `log_every` steps late, and always before a checkpoint is written, so a non-finite
    state is never saved.
    """

    setup: Setup
    workdir: str
    data: Any
    val: Batch | None
    checkpointer: Checkpointer
    writer: MetricsWriter
    pending: list[tuple[int, dict]] = dataclasses.field(default_factory=list)
    last_loss: float | None = None

    def loop(self, state: TrainState, step: int, end: int, stop_requests: _StopRequests):
        cfg = self.setup.cfg
        profiler = _ProfilerWindow(cfg.profile_start, cfg.profile_steps, self.workdir)
        self._window_start, self._window_steps = time.perf_counter(), 0
        first = step + 1
        try:
            while step < end:
                profiler.before(step)
                batch = self.setup.global_batch(next(self.data))
                state, metrics = self.setup.train_step(state, batch)
                step += 1
                profiler.after(step)
                if step == first:
                    self._restart_window_after(metrics)
                else:
                    self._window_steps += 1
                self._after_step(step, end, state, metrics)
                stop_signal = stop_requests.requested(step)
                if stop_signal is not None:
                    return self._save_and_stop(step, end, state, stop_signal)
        finally:
            profiler.close()
        self._flush(end)
        self._save_unless_saved(step, state)
        self.checkpointer.wait()
        return TrainResult(step, state, self.last_loss)

    def _save_and_stop(
        self, step: int, end: int, state: TrainState, stop_signal: str
    ) -> TrainResult:
        if stop_signal == "SIGINT":
            self.writer.print(f"Ctrl-C: saving step {step} (Ctrl-C again stops at once, unsaved)")
        self._flush(end)
        self._save_unless_saved(step, state)
        self.checkpointer.wait()
        if stop_signal == "SIGTERM":
            self.writer.print(f"SIGTERM: saved step {step} to {self.workdir}, exiting")
        return TrainResult(
            step,
            state,
            self.last_loss,
            preempted=stop_signal == "SIGTERM",
            interrupted=stop_signal == "SIGINT",
        )

    def _restart_window_after(self, metrics: dict) -> None:
        """Start timing once the first step, which compiles, has run."""
        jax.block_until_ready(metrics)
        self._window_start, self._window_steps = time.perf_counter(), 0

    def _after_step(self, step: int, end: int, state: TrainState, metrics: dict) -> None:
        """Check, log, validate and checkpoint after a step."""
        cfg = self.setup.cfg
        self.pending.append((step, metrics))
        validate = self.val is not None and step % cfg.eval_every == 0
        save = step % cfg.checkpoint_every == 0
        if validate or save or _logs(step, end, cfg.log_every):
            self._flush(end)
        if validate:
            started = time.perf_counter()
            self.writer.write(step, {"val_loss": self._validate(state)})
            self._window_start += time.perf_counter() - started
        self.writer.advance()
        if save:
            self._save(step, state)

    def _flush(self, end: int) -> None:
        """Read back the metrics of the steps not yet checked; check and log them in order."""
        pending, self.pending = self.pending, []
        values = jax.device_get([metrics for _, metrics in pending])
        for (step, _), metrics in zip(pending, values, strict=True):
            loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
            self._check_finite(step, loss, grad_norm, bool(metrics["state_finite"]))
            self.last_loss = loss
            if _logs(step, end, self.setup.cfg.log_every):
                self._log(step, loss, grad_norm, metrics)

    def _save(self, step: int, state: TrainState, force: bool = False) -> None:
        config = self.setup.cfg.to_dict()
        self.checkpointer.save(step, state, self.data.get_state(), config, force=force)

    def _save_unless_saved(self, step: int, state: TrainState) -> None:
        if self.checkpointer.latest_step() != step:
            self._save(step, state, force=True)

    def _check_finite(self, step: int, loss: float, grad_norm: float, state_finite: bool) -> None:
        """Stop on a non-finite loss, gradient norm or updated state, leaving only checkpoints
        known to be good.

        A checkpoint is good when the loss and gradient norm computed from its parameters (by
        the step after it) are finite: parameters can be finite yet so large that the next
        loss or gradient overflows. So a non-finite loss or gradient norm at step `step`
        condemns the checkpoint of step `step - 1`, which is moved aside to
        `checkpoints/STEP.nonfinite` (never deleted); a non-finite updated state is never
        saved. Every checkpoint left is then one whose next step was finite.
        """
        if math.isfinite(loss) and math.isfinite(grad_norm):
            if state_finite:
                self.checkpointer.mark_good(step - 1)
                return
            cause = f"the update of step {step} made parameters or optimizer state non-finite"
            moved = ""
        else:
            cause = f"loss {loss}, grad norm {grad_norm} at step {step}"
            moved = self._set_aside_nonfinite(step - 1)
        latest = self.checkpointer.latest_step()
        if latest is None:
            resume = f"no good checkpoint is left in {self.workdir}; a new run starts from step 0"
        else:
            resume = f"the last good checkpoint is step {latest} in {self.workdir}"
        raise NonFiniteLossError(f"{cause}: training stopped; {resume}{moved}")

    def _set_aside_nonfinite(self, step: int) -> str:
        """Move the checkpoint of `step`, whose parameters gave a non-finite loss or gradient,
        out of the way of resuming; returns a note for the error message."""
        self.checkpointer.wait()
        if step not in self.checkpointer.steps():
            return ""
        path = self.checkpointer.set_aside(step, "nonfinite")
        return f" (checkpoint step {step}, whose parameters gave this, was moved to {path})"

    def _log(self, step: int, loss: float, grad_norm: float, metrics: dict) -> None:
        """Write the record of a log step.

        tokens_per_s, step_time_s and mfu are over the steps since the last record, leaving
        out the first step of a `train` call (it compiles) and the time spent validating; a
        record whose window holds no other step has none of them.
        """
        cfg = self.setup.cfg
        record = {
            "loss": loss,
            "grad_norm": grad_norm,
            **learning_rates(cfg.optim, cfg.steps, step - 1),
            "trained_tokens": float(metrics["trained_tokens"]),
        }
        if self._window_steps:
            record.update(self._throughput(time.perf_counter() - self._window_start))
        self.writer.write(step, record)
        self._window_start, self._window_steps = time.perf_counter(), 0

    def _throughput(self, elapsed: float) -> dict[str, float]:
        cfg = self.setup.cfg
        tokens_per_step = cfg.accum_steps * cfg.batch_size * cfg.seq_len
        record = {
            "tokens_per_s": self._window_steps * tokens_per_step / elapsed,
            "step_time_s": elapsed / self._window_steps,
        }
        peak = device_peak_flops(jax.devices()[0])
        if peak is not None:
            n_params = count_params(self.setup.abstract_state.params)
            flops = train_flops_per_token(cfg.model, n_params) * tokens_per_step
            record["mfu"] = flops * self._window_steps / elapsed / (peak * jax.device_count())
        return record

    def _validate(self, state: TrainState) -> float:
        loss_sum, count = self.setup.eval_step(state.params, state.consts, self.val)
        return float(loss_sum) / max(float(count), 1.0)


def _logs(step: int, end: int, log_every: int) -> bool:
    return step % log_every == 0 or step == end


class _ProfilerWindow:
    """A jax.profiler trace over steps [start, start + steps) into WORKDIR/profile."""

    def __init__(self, start: int, steps: int, workdir: str):
        self.start, self.stop, self.workdir = start, start + steps, workdir
        self.active = False

    def before(self, step: int) -> None:
        if step == self.start and self.stop > self.start:
            jax.profiler.start_trace(os.path.join(self.workdir, "profile"))
            self.active = True

    def after(self, step: int) -> None:
        if self.active and step >= self.stop:
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
