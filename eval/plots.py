"""Figures of the evaluation results (matplotlib, Agg backend: files only, no display)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib import ticker

from bam_jax.config import SSMAX_SUFFIX

CLASS_STYLE = {"local": "-", "retrieval": "--"}
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
# Coinciding curves of a comparison stay visible when each is shifted by a few percent along
# the log length axis; the shift is far smaller than the factor 2 between measured lengths.
DODGE_FRACTION = 0.035
PENALTY_FLOOR = 1e-6
# A key whose penalty exceeds this has an attention weight below exp(-1000) of the mode's:
# larger values carry no information and would squeeze every other curve into the bottom.
PENALTY_CEILING = 1e3


def _save(fig: plt.Figure, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plain_log_ticks(axis: matplotlib.axis.Axis) -> None:
    """Log-axis tick labels written as numbers (128, 16k), not powers of ten. Minor ticks are
    labelled on short axes: all of them under one decade, those at 2 and 5 times a power of
    ten under two."""
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: _short_number(v)))
    axis.set_minor_formatter(ticker.FuncFormatter(lambda v, _: _minor_label(axis, v)))


def _minor_label(axis: matplotlib.axis.Axis, value: float) -> str:
    low, high = sorted(axis.get_view_interval())
    decades = np.log10(high / low) if low > 0 else np.inf
    mantissa = round(value / 10 ** np.floor(np.log10(value)))
    if decades < 1 or (decades < 2 and mantissa in (2, 5)):
        return _short_number(value)
    return ""


def _short_number(value: float) -> str:
    """128, 4096, 16k (a multiple of 1024 above 10000), 20k, 0.5."""
    if value >= 10_000:
        if value % 1024 == 0:
            return f"{value / 1024:g}k"
        return f"{value / 1000:g}k"
    return f"{value:g}"


def _mark_train_length(ax: plt.Axes, train_lengths: Sequence[int | None]) -> None:
    """A dotted line at each training length, named in the legend (not on the plot, where a
    label would collide with the points)."""
    for n in sorted({t for t in train_lengths if t}):
        ax.axvline(n, color="grey", linestyle=":", linewidth=1, label=f"training length {n}")


def _shared_train_length(train_lengths: Mapping[str, int | None]) -> int | None:
    lengths = {t for t in train_lengths.values() if t}
    return lengths.pop() if len(lengths) == 1 else None


def _add_multiple_axis(ax: plt.Axes, train_length: int | None) -> None:
    """A top axis in multiples of the training length."""
    if not train_length:
        return
    top = ax.secondary_xaxis(
        "top", functions=(lambda x: x / train_length, lambda m: m * train_length)
    )
    top.set_xscale("log")
    top.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    top.xaxis.set_minor_formatter(
        ticker.FuncFormatter(lambda v, _: _minor_label(top.xaxis, v) and f"{v:g}x")
    )
    top.set_xlabel("multiple of the training length")


def _style(names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """One colour per base encoding, solid without SSMax and dashed with it, and a marker and
    a small shift per curve, so that variants group by colour and coinciding curves show."""
    bases = list(dict.fromkeys(n.removesuffix(SSMAX_SUFFIX) for n in names))
    colours = plt.get_cmap("tab10")
    styles = {}
    for i, name in enumerate(names):
        base = name.removesuffix(SSMAX_SUFFIX)
        styles[name] = {
            "color": colours(bases.index(base) % 10),
            "linestyle": "--" if name.endswith(SSMAX_SUFFIX) else "-",
            "marker": MARKERS[i % len(MARKERS)],
            "dodge": 1.0 + DODGE_FRACTION * (i - (len(names) - 1) / 2) if len(names) > 1 else 1.0,
        }
    return styles


def accuracy_vs_length(
    curves: Mapping[str, Sequence[Mapping[str, Any]]],
    train_lengths: Mapping[str, int | None],
    path: str,
    *,
    title: str = "Passkey retrieval",
) -> str:
    """One line per model: accuracy at each target length (the columns of the printed table),
    log x axis, the training length marked and a top axis in multiples of it."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5), layout="constrained")
    styles = _style(list(curves))
    for name, entries in curves.items():
        style = styles[name]
        xs = [style["dodge"] * _target_length(e) for e in entries]
        ys = [100.0 * e["accuracy"] for e in entries]
        _accuracy_line(ax, style, xs, ys, name)
    train = list(train_lengths.values())
    _accuracy_axes(ax, train, _shared_train_length(train_lengths), "accuracy (%)", title)
    return _save(fig, path)


def _accuracy_line(ax: plt.Axes, style: dict[str, Any], xs, ys, name: str) -> None:
    ax.plot(
        xs,
        ys,
        color=style["color"],
        linestyle=style["linestyle"],
        marker=style["marker"],
        markerfacecolor="none",
        label=name,
    )


def _accuracy_axes(
    ax: plt.Axes, train_lengths: list, shared_train_length, ylabel: str, title: str
) -> None:
    """Log length axis with the training length(s) marked and a multiples axis on top."""
    _mark_train_length(ax, train_lengths)
    ax.set_xscale("log")
    _plain_log_ticks(ax.xaxis)
    _add_multiple_axis(ax, shared_train_length)
    ax.set_ylim(-3, 103)
    ax.set_xlabel("target prompt length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")


def accuracy_band(
    spread: Mapping[str, Mapping[int, tuple[float, float, float]]],
    train_length: int,
    path: str,
    *,
    title: str,
) -> str:
    """One line per group (the mean accuracy over its runs, %) with a band from the lowest
    to the highest run at each length; log x axis, the training length marked."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5), layout="constrained")
    styles = _style(list(spread))
    for name, per_length in spread.items():
        style = styles[name]
        xs = [style["dodge"] * n for n in per_length]
        mean, low, high = (np.asarray(column) for column in zip(*per_length.values(), strict=True))
        ax.fill_between(xs, low, high, color=style["color"], alpha=0.18, linewidth=0)
        _accuracy_line(ax, style, xs, mean, name)
    ylabel = "accuracy (%): mean, band from lowest to highest seed"
    _accuracy_axes(ax, [train_length], train_length, ylabel, title)
    return _save(fig, path)


def _target_length(entry: Mapping[str, Any]) -> int:
    return max(int(entry.get("target_length") or entry["prompt_length"]), 1)


def depth_heatmap(
    entries: Sequence[Mapping[str, Any]], path: str, *, title: str, bins: int = 10
) -> str:
    """Accuracy per (length, needle depth bin): rows are depths (0 = start), columns target
    lengths; each cell shows its sample count, and cells without samples are hatched."""
    bins = max(1, min(bins, max(len(e["depths"]) for e in entries)))
    accuracy_grid, counts_grid = _depth_grid(entries, bins)
    fig, ax = plt.subplots(
        figsize=(max(5.5, 0.75 * len(entries) + 2.5), 0.4 * bins + 2.2), layout="constrained"
    )
    ax.set_facecolor("white")
    image = ax.imshow(
        100 * accuracy_grid, aspect="auto", cmap="RdYlGn", vmin=0, vmax=100, origin="upper"
    )
    for depth, col in zip(*np.nonzero(counts_grid == 0), strict=True):
        ax.add_patch(
            plt.Rectangle((col - 0.5, depth - 0.5), 1, 1, fill=False, hatch="///", color="0.75")
        )
    for depth, col in zip(*np.nonzero(counts_grid), strict=True):
        ax.text(col, depth, f"{int(counts_grid[depth, col])}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(entries)), [_short_number(_target_length(e)) for e in entries])
    ax.set_yticks(range(bins), [f"{(b + 0.5) / bins:.0%}" for b in range(bins)])
    ax.set_xlabel("target prompt length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, label="accuracy (%)")
    fig.text(
        0.01,
        0.0,
        "number in a cell: samples; hatched: no sample at that depth",
        fontsize=7,
        va="bottom",
    )
    return _save(fig, path)


def _depth_grid(entries: Sequence[Mapping[str, Any]], bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Accuracy (NaN where empty) and sample counts, both [depth bins, lengths]."""
    sums_grid = np.zeros((bins, len(entries)))
    counts_grid = np.zeros((bins, len(entries)))
    for col, e in enumerate(entries):
        for depth, ok in zip(e["depths"], e["correct"], strict=True):
            row = min(int(depth * bins), bins - 1)
            sums_grid[row, col] += ok
            counts_grid[row, col] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        accuracy_grid = np.where(counts_grid > 0, sums_grid / counts_grid, np.nan)
    return accuracy_grid, counts_grid


def perplexity_vs_position(
    curves: Mapping[str, Mapping[str, Any]],
    train_lengths: Mapping[str, int | None],
    path: str,
    *,
    title: str = "Perplexity by position",
) -> str:
    """One line per model: perplexity of each window at the window's end position, with a
    band of exp(mean loss +- loss_std / sqrt(sequences)), which bounds one standard error of
    the window's mean from above."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5), layout="constrained")
    styles = _style(list(curves))
    for name, curve in curves.items():
        style = styles[name]
        positions = np.asarray(curve["positions"], np.float64)
        ax.plot(
            positions,
            curve["perplexity"],
            color=style["color"],
            linestyle=style["linestyle"],
            marker=".",
            label=name,
        )
        if "loss" in curve and "loss_std" in curve:
            mean = np.asarray(curve["loss"])
            spread = np.asarray(curve["loss_std"]) / np.sqrt(max(curve.get("n_sequences", 1), 1))
            ax.fill_between(
                positions,
                np.exp(mean - spread),
                np.exp(mean + spread),
                color=style["color"],
                alpha=0.15,
            )
    _mark_train_length(ax, list(train_lengths.values()))
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log_ticks(ax.xaxis)
    _plain_log_ticks(ax.yaxis)
    _add_multiple_axis(ax, _shared_train_length(train_lengths))
    ax.set_xlabel("position (end of window, tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, title="band: ±1 standard error (upper bound)", title_fontsize=7)
    return _save(fig, path)


def perplexity_band(
    spread: Mapping[str, Mapping[int, tuple[float, float, float]]],
    train_length: int,
    path: str,
    *,
    title: str,
) -> str:
    """One line per group: the perplexity of its mean loss per window (at the window's end
    position), with a band from its lowest to its highest run; log axes, the training
    length marked."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5), layout="constrained")
    styles = _style(list(spread))
    for name, per_window in spread.items():
        style = styles[name]
        positions = np.asarray(list(per_window), np.float64)
        mean, low, high = (np.exp(column) for column in zip(*per_window.values(), strict=True))
        ax.fill_between(positions, low, high, color=style["color"], alpha=0.15, linewidth=0)
        ax.plot(
            positions,
            mean,
            color=style["color"],
            linestyle=style["linestyle"],
            marker=style["marker"],
            markersize=3,
            label=name,
        )
    _mark_train_length(ax, [train_length])
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log_ticks(ax.xaxis)
    _plain_log_ticks(ax.yaxis)
    _add_multiple_axis(ax, train_length)
    ax.set_xlabel("position (end of window, tokens)")
    ax.set_ylabel("perplexity (exp of the mean loss over seeds)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2, title="band: lowest to highest seed", title_fontsize=7)
    return _save(fig, path)


def prior_figure(
    curves: Sequence[Mapping[str, Any]],
    table: Sequence[Mapping[str, Any]],
    path: str,
    *,
    title: str,
    train_length: int | None = None,
) -> str:
    """Penalty -log prior vs distance per layer (log-log), head classes by line style, and the
    parameter table in its own panel below the curves."""
    layers = list(dict.fromkeys(c["layer"] for c in curves))
    cols = max(1, min(3, len(layers)))
    rows = int(np.ceil(len(layers) / cols))
    table_height = 0.25 * (len(table) + 1) + 0.3
    fig = plt.figure(
        figsize=(max(8.0, 4.5 * cols), 3.4 * rows + table_height), layout="constrained"
    )
    grid = fig.add_gridspec(rows + 1, cols, height_ratios=[3.4] * rows + [table_height])
    for i, layer in enumerate(layers):
        ax = fig.add_subplot(grid[i // cols, i % cols])
        _prior_panel(ax, [c for c in curves if c["layer"] == layer], train_length)
        ax.set_title("shared by all layers" if layer == "all" else f"layer {layer}", fontsize=9)
        if i % cols == 0:
            ax.set_ylabel("penalty  -log prior")
        if i == 0:
            ax.legend(fontsize=6, ncol=2)
    _table_axes(fig.add_subplot(grid[rows, :]), table)
    fig.suptitle(title)
    return _save(fig, path)


def _prior_panel(
    ax: plt.Axes, curves: Sequence[Mapping[str, Any]], train_length: int | None
) -> None:
    """The bias is never positive, so its negative is drawn on a log axis (floored at
    PENALTY_FLOOR where a prior reaches zero, at its mode)."""
    for c in curves:
        penalty = np.maximum(-np.asarray(c["bias"], np.float64), PENALTY_FLOOR)
        ax.plot(
            c["distance"],
            penalty,
            CLASS_STYLE.get(c["class"], "-"),
            label=f"h{c['head']} {c['class']}",
            linewidth=1,
        )
    if train_length:
        ax.axvline(train_length, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlim(min(min(c["distance"]) for c in curves), max(max(c["distance"]) for c in curves))
    ax.set_yscale("log")
    ax.set_ylim(top=min(ax.get_ylim()[1], PENALTY_CEILING))
    _plain_log_ticks(ax.xaxis)
    ax.set_xlabel("distance |i - j| (dotted: training length)")
    ax.grid(True, which="major", alpha=0.3)


def _table_axes(ax: plt.Axes, table: Sequence[Mapping[str, Any]]) -> None:
    ax.axis("off")
    if not table:
        return
    columns = list(table[0])
    cells = [[format_cell(row[c]) for c in columns] for row in table]
    drawn = ax.table(
        cellText=cells, colLabels=columns, loc="center", cellLoc="center", bbox=[0, 0, 1, 1]
    )
    drawn.auto_set_font_size(False)
    drawn.set_fontsize(7)


def format_cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "" if value is None else str(value)


def learning_curve(points: Sequence[Mapping[str, Any]], path: str, *, title: str) -> str:
    """Zero-shot accuracy of each checkpoint against the tokens trained on: whole names
    copied (solid), letters of the names (dotted), letters of the names in the copy probe's
    piece form (dash-dot) and passkeys (dashed), one colour per multiple of the training
    length."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5), layout="constrained")
    millions = [p["tokens"] / 1e6 for p in points]
    for i, multiple in enumerate(points[0]["copy"]):
        color = f"C{i}"
        for key, style, what in (
            ("copy", "-", "copy probe, names"),
            ("copy_letters", ":", "copy probe, letters"),
            ("piece_letters", "-.", "copy probe, piece form, letters"),
            ("passkey", "--", "passkey"),
        ):
            ys = [100.0 * p[key][multiple] for p in points]
            ax.plot(millions, ys, style, color=color, marker="o", label=f"{what} {multiple}")
    ax.set_ylim(-3, 103)
    ax.set_xlabel("tokens trained on (millions)")
    ax.set_ylabel("zero-shot accuracy (%)")
    ax.set_title(f"{title}: learning curve")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, path)
