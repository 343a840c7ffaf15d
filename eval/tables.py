"""The tables bam-eval and bam-quickstart print: accuracy and perplexity per model and
length or window, and their spread over seeds."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def copy_table(curves: dict[str, list[dict[str, Any]]], train_lengths: dict[str, int]) -> str:
    """Names copied exactly / letters right (%) per model and length."""
    return length_table(
        curves,
        train_lengths,
        lambda e: f"{100 * e['accuracy']:.0f} / {100 * e['letter_accuracy']:.0f}",
    )


def task_label(task: str, needles: int) -> str:
    """The task's name in figure files: passkey, or e.g. multikey4."""
    return task if task == "passkey" else f"{task}{needles}"


def passkey_table(curves: dict[str, list[dict[str, Any]]], train_lengths: dict[str, int]) -> str:
    """Accuracy (%) per model and length."""
    return length_table(curves, train_lengths, lambda e: f"{100 * e['accuracy']:.0f}")


def length_table(
    curves: dict[str, list[dict[str, Any]]],
    train_lengths: dict[str, int],
    cell: Callable[[dict[str, Any]], str],
) -> str:
    """Rows: models; columns: target lengths (with the multiple of the training length
    when all models share one); each cell `cell(entry)`."""
    lengths = sorted({e["target_length"] for entries in curves.values() for e in entries})
    shared = set(train_lengths.values())
    header = ["model", "train"] + [
        f"{n}" + (f" ({n / next(iter(shared)):g}x)" if len(shared) == 1 else "") for n in lengths
    ]
    rows = []
    for name, entries in curves.items():
        by_length = {e["target_length"]: e for e in entries}
        rows.append(
            [name, str(train_lengths[name])]
            + [cell(by_length[n]) if n in by_length else "-" for n in lengths]
        )
    return format_table(header, rows)


def seed_summary(
    curves: dict[str, list[dict[str, Any]]], groups: dict[str, list[str]], train_length: int
) -> str:
    """Rows: groups (e.g. an encoding's runs over seeds); columns: target lengths, each cell
    the mean accuracy (%) and its range over the group's runs, "mean [min-max]"."""
    stats = accuracy_spread(curves, groups)
    lengths = sorted({n for per_length in stats.values() for n in per_length})
    header = ["model", "runs"] + [f"{n} ({n / train_length:g}x)" for n in lengths]
    rows = []
    for group, per_length in stats.items():
        cells = [
            "{:.0f} [{:.0f}-{:.0f}]".format(*per_length[n]) if n in per_length else "-"
            for n in lengths
        ]
        rows.append([group, str(len(groups[group])), *cells])
    return format_table(header, rows)


def accuracy_spread(
    curves: dict[str, list[dict[str, Any]]], groups: dict[str, list[str]]
) -> dict[str, dict[int, tuple[float, float, float]]]:
    """Per group and target length: (mean, min, max) accuracy in % over the group's runs
    that reached that length. A run whose sweep stopped at 0% (`--patience`) counts as 0%
    at the longer lengths that other runs of its group reached."""
    spread = {}
    for group, names in groups.items():
        lengths = sorted({entry["target_length"] for name in names for entry in curves[name]})
        by_length: dict[int, list[float]] = {}
        for name in names:
            accuracy = {entry["target_length"]: 100 * entry["accuracy"] for entry in curves[name]}
            last = max(accuracy, default=None)
            stopped_at_zero = last is not None and accuracy[last] == 0.0
            for n in lengths:
                if n in accuracy or (stopped_at_zero and n > last):
                    by_length.setdefault(n, []).append(accuracy.get(n, 0.0))
        spread[group] = {n: (sum(v) / len(v), min(v), max(v)) for n, v in by_length.items()}
    return spread


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def perplexity_table(curves: dict[str, dict[str, Any]]) -> str:
    """Rows: window ends; columns: models."""
    positions = next(iter(curves.values()))["positions"]
    rows = [
        [str(p)] + [f"{c['perplexity'][i]:.2f}" for c in curves.values()]
        for i, p in enumerate(positions)
    ]
    return format_table(["position", *curves], rows)


def perplexity_spread(
    curves: dict[str, dict[str, Any]], groups: dict[str, list[str]]
) -> dict[str, dict[int, tuple[float, float, float]]]:
    """Per group and window end position: (mean, min, max) of the window's mean next-token
    loss over the group's runs (perplexity is exp of each)."""
    spread = {}
    for group, names in groups.items():
        losses = np.asarray([curves[name]["loss"] for name in names], np.float64)
        positions = curves[names[0]]["positions"]
        spread[group] = {
            int(p): (
                float(losses[:, i].mean()),
                float(losses[:, i].min()),
                float(losses[:, i].max()),
            )
            for i, p in enumerate(positions)
        }
    return spread


def perplexity_seed_table(
    spread: dict[str, dict[int, tuple[float, float, float]]],
    train_length: int,
    positions: Sequence[int],
    *,
    perplexity: bool = False,
) -> str:
    """Rows: window end positions (with their multiple of the training length); columns:
    groups, each cell the mean loss (or exp of it, the perplexity) and its range over the
    group's runs, "mean [min-max]"."""
    rows = []
    for p in positions:
        cells = []
        for per_window in spread.values():
            values = np.exp(per_window[p]) if perplexity else per_window[p]
            cells.append("{:.3f} [{:.3f}-{:.3f}]".format(*values))
        rows.append([f"{p} ({p / train_length:g}x)", *cells])
    return format_table(["window end", *spread], rows)
