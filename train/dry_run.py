"""`--dry-run`: the steps compiled for the sharded state, unallocated, and memory per device."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import jax

from bam_jax.model_state import count_params
from bam_train.checkpoint import readable_size
from bam_train.data import train_iterator
from bam_train.setup import Setup, validation_set
from bam_train.step import Batch

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
    train_compiled, train_s = _compile(
        "train step", setup.train_step, state, train_batch, setup.step_values
    )
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
