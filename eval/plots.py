"""Figures of the evaluation results (matplotlib, Agg backend: files only, no display)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

CLASS_STYLE = {"local": "-", "retrieval": "--"}


def _save(fig: plt.Figure, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _mark_train_lengths(ax: plt.Axes, train_lengths: Sequence[int | None]) -> None:
    for n in sorted({t for t in train_lengths if t}):
        ax.axvline(n, color="grey", linestyle=":", linewidth=1)
        ax.annotate(
            f"train {n}",
            (n, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color="grey",
        )


def accuracy_vs_length(
    curves: Mapping[str, Sequence[Mapping[str, Any]]],
    train_lengths: Mapping[str, int | None],
    path: str,
    *,
    title: str = "Passkey retrieval",
) -> str:
    """One line per model: accuracy vs prompt length, log x axis, training length marked."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, entries in curves.items():
        xs = [max(e["prompt_length"], 1) for e in entries]
        ys = [100.0 * e["accuracy"] for e in entries]
        ax.plot(xs, ys, marker="o", label=name)
    _mark_train_lengths(ax, list(train_lengths.values()))
    ax.set_xscale("log")
    ax.set_ylim(-3, 103)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def depth_heatmap(
    entries: Sequence[Mapping[str, Any]], path: str, *, title: str, bins: int = 10
) -> str:
    """Accuracy per (length, needle depth bin): rows are depths (0 = start), columns lengths."""
    bins = max(1, min(bins, max(len(e["depths"]) for e in entries)))
    grid = np.full((bins, len(entries)), np.nan)
    for col, e in enumerate(entries):
        sums, counts = np.zeros(bins), np.zeros(bins)
        for depth, ok in zip(e["depths"], e["correct"], strict=True):
            b = min(int(depth * bins), bins - 1)
            sums[b] += ok
            counts[b] += 1
        with np.errstate(invalid="ignore"):
            grid[:, col] = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    fig, ax = plt.subplots(figsize=(max(5, 0.6 * len(entries) + 2), 4))
    image = ax.imshow(100 * grid, aspect="auto", cmap="RdYlGn", vmin=0, vmax=100, origin="upper")
    ax.set_xticks(range(len(entries)), [_short(e["prompt_length"]) for e in entries], rotation=45)
    ax.set_yticks(range(bins), [f"{(b + 0.5) / bins:.0%}" for b in range(bins)])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="accuracy (%)")
    return _save(fig, path)


def perplexity_vs_position(
    curves: Mapping[str, Mapping[str, Any]],
    train_lengths: Mapping[str, int | None],
    path: str,
    *,
    title: str = "Perplexity by position",
) -> str:
    """One line per model: perplexity of each window, at the window's end position."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in curves.items():
        ax.plot(curve["positions"], curve["perplexity"], marker=".", label=name)
    _mark_train_lengths(ax, list(train_lengths.values()))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("position (end of window, tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def prior_figure(
    curves: Sequence[Mapping[str, Any]],
    table: Sequence[Mapping[str, Any]],
    path: str,
    *,
    title: str,
    train_length: int | None = None,
) -> str:
    """Bias vs distance per layer (log distance axis), head classes by line style, and the
    parameter table below the curves."""
    layers = list(dict.fromkeys(c["layer"] for c in curves))
    cols = max(1, min(3, len(layers)))
    rows = int(np.ceil(len(layers) / cols))
    table_height = 0.22 * (len(table) + 1)
    fig = plt.figure(figsize=(max(8.0, 4.5 * cols), 3.2 * rows + table_height))
    grid = fig.add_gridspec(rows + 1, cols, height_ratios=[3.2] * rows + [table_height])
    for i, layer in enumerate(layers):
        ax = fig.add_subplot(grid[i // cols, i % cols])
        for c in (c for c in curves if c["layer"] == layer):
            ax.plot(
                c["distance"],
                c["bias"],
                CLASS_STYLE.get(c["class"], "-"),
                label=f"h{c['head']} {c['class']}",
                linewidth=1,
            )
        if train_length:
            ax.axvline(train_length, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_ylim(top=0.0)  # a GGD or ALiBi bias is never positive
        ax.set_xlabel("distance |i - j|")
        ax.set_ylabel("log-prior bias")
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        if i == 0:
            ax.legend(fontsize=6, ncol=2)
    _table_axes(fig.add_subplot(grid[rows, :]), table)
    fig.suptitle(title)
    return _save(fig, path)


def _table_axes(ax: plt.Axes, table: Sequence[Mapping[str, Any]]) -> None:
    ax.axis("off")
    if not table:
        return
    columns = list(table[0])
    cells = [[format_cell(row[c]) for c in columns] for row in table]
    drawn = ax.table(cellText=cells, colLabels=columns, loc="upper center", cellLoc="center")
    drawn.auto_set_font_size(False)
    drawn.set_fontsize(7)
    drawn.auto_set_column_width(list(range(len(columns))))


def format_cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "" if value is None else str(value)


def _short(n: int) -> str:
    return f"{n / 1000:.0f}k" if n >= 10_000 else (f"{n / 1000:.1f}k" if n >= 1000 else str(n))
