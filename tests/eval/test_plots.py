"""Every evaluation figure renders from a small fixture with no text drawn over other text."""

from __future__ import annotations

import itertools
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.table import Table
from matplotlib.text import Text

from bam_eval import plots

TRAIN_LENGTH = 128
MULTIPLES = (1, 2, 4, 8, 16, 32, 64, 125, 250, 500)


def passkey_entries(accuracies: list[float], samples: int = 10) -> list[dict]:
    rng = np.random.default_rng(0)
    entries = []
    for multiple, accuracy in zip(MULTIPLES, accuracies, strict=True):
        target = multiple * TRAIN_LENGTH
        correct = [bool(i < round(accuracy * samples)) for i in range(samples)]
        entries.append(
            {
                "target_length": target,
                "multiple": float(multiple),
                "prompt_length": target - 12,
                "accuracy": accuracy,
                "depths": sorted(rng.uniform(0, 1, samples).tolist()),
                "correct": correct,
            }
        )
    return entries


def comparison_curves() -> dict[str, list[dict]]:
    perfect = [1.0] * len(MULTIPLES)
    return {
        "bam_ssmax": passkey_entries(perfect),
        "bam": passkey_entries([1.0, 1.0, 0.9, 0.6, 0.3, 0.1, 0.0, 0.0, 0.0, 0.0]),
        "rope_ssmax": passkey_entries(perfect[:1] + [0.0] * 9),
        "rope": passkey_entries(perfect[:1] + [0.0] * 9),
        "alibi_ssmax": passkey_entries([1.0, 1.0, 1.0, 0.8, 0.5, 0.3, 0.1, 0.1, 0.0, 0.0]),
    }


def perplexity_curve(level: float) -> dict:
    positions = [64 * (k + 1) for k in range(8)]
    loss = [np.log(level) + 0.02 * k for k in range(8)]
    return {
        "positions": positions,
        "loss": loss,
        "loss_std": [1.5] * 8,
        "perplexity": np.exp(loss).tolist(),
        "n_sequences": 12,
    }


def prior_inputs(layers: list) -> tuple[list[dict], list[dict]]:
    distance = np.unique(np.round(np.logspace(0, np.log10(500 * TRAIN_LENGTH), 30)))
    curves, table = [], []
    for layer in layers:
        for head, (alpha, beta) in enumerate([(3.0, 2.1), (1.0, 0.1), (0.5, -0.9), (2.0, -0.3)]):
            kind = "local" if beta > 0 else "retrieval"
            bias = (
                -(np.abs(distance / np.exp(alpha)) ** np.exp(beta)) if beta > 0 else -0.1 / distance
            )
            curves.append(
                {
                    "layer": layer,
                    "head": head,
                    "class": kind,
                    "distance": distance.tolist(),
                    "bias": bias.tolist(),
                }
            )
            table.append(
                {
                    "layer": layer,
                    "head": head,
                    "theta_alpha": alpha,
                    "theta_beta": beta,
                    "theta_mu": 0.0,
                    "class": kind,
                    "ssmax_scale": 0.05 * (head + 1),
                }
            )
    return curves, table


def drawn_tick_labels(fig: Figure) -> tuple[list[Text], set[int]]:
    """The tick labels matplotlib draws (ticks inside the view), and the ids of all."""
    drawn, every = [], set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                labels = (tick.label1, tick.label2)
                every.update(id(label) for label in labels)
                if low * (1 - 1e-9) <= tick.get_loc() <= high * (1 + 1e-9):
                    drawn.extend(label for label in labels if label.get_visible())
    return drawn, every


def overlapping_texts(fig: Figure) -> list[tuple[str, str]]:
    """Pairs of drawn, non-empty texts whose boxes intersect (cells of one table, which the
    table lays out itself, are compared with everything else but not with each other)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ticks, tick_ids = drawn_tick_labels(fig)
    others = [t for t in fig.findobj(Text) if id(t) not in tick_ids and t.get_visible()]
    texts = [t for t in ticks + others if t.get_text().strip()]
    boxes = [(t, t.get_window_extent(renderer).shrunk(0.95, 0.9)) for t in texts]
    in_table = {id(t) for table in fig.findobj(Table) for t in table.findobj(Text)}
    clashes = []
    for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
        if id(a) in in_table and id(b) in in_table:
            continue
        if box_a.overlaps(box_b):
            clashes.append((a.get_text(), b.get_text()))
    return clashes


@pytest.fixture
def captured(monkeypatch):
    """The figures drawn, kept open for inspection instead of being closed after saving."""
    figures: list[Figure] = []

    def save(fig: Figure, path: str) -> str:
        fig.savefig(path, dpi=120)
        figures.append(fig)
        return path

    monkeypatch.setattr(plots, "_save", save)
    yield figures
    for fig in figures:
        plt.close(fig)


def test_accuracy_plot_uses_target_lengths_and_a_multiple_axis(captured, tmp_path: Path):
    curves = comparison_curves()
    plots.accuracy_vs_length(
        curves, dict.fromkeys(curves, TRAIN_LENGTH), str(tmp_path / "acc.png"), title="Passkey"
    )
    (fig,) = captured
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    targets = np.array([m * TRAIN_LENGTH for m in MULTIPLES], np.float64)
    for name, style in plots._style(list(curves)).items():
        np.testing.assert_allclose(lines[name].get_xdata() / style["dodge"], targets, rtol=1e-12)
    top_labels = [t.get_text() for t in fig.findobj(Text)]
    assert "multiple of the training length" in top_labels
    assert overlapping_texts(fig) == []


def test_ssmax_variants_share_the_colour_of_their_base(captured, tmp_path: Path):
    curves = comparison_curves()
    plots.accuracy_vs_length(curves, dict.fromkeys(curves, TRAIN_LENGTH), str(tmp_path / "a.png"))
    lines = {line.get_label(): line for line in captured[0].axes[0].get_lines()}
    assert lines["rope"].get_color() == lines["rope_ssmax"].get_color()
    assert lines["rope"].get_color() != lines["bam"].get_color()
    assert lines["rope_ssmax"].get_linestyle() != lines["rope"].get_linestyle()
    assert len({tuple(line.get_xdata()) for line in lines.values()}) == len(lines)


def test_depth_heatmap_counts_samples_and_marks_empty_cells(captured, tmp_path: Path):
    entries = passkey_entries([1.0, 0.9, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], samples=4)
    plots.depth_heatmap(entries, str(tmp_path / "depth.png"), title="bam_ssmax: depth")
    (fig,) = captured
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert sum(int(t) for t in texts) == 4 * len(entries)
    bins = 4
    hatched = [p for p in fig.axes[0].patches if p.get_hatch()]
    assert len(hatched) == bins * len(entries) - len(texts) > 0
    assert overlapping_texts(fig) == []


def test_perplexity_plot_has_a_band_and_plain_ticks(captured, tmp_path: Path):
    curves = {"bam": perplexity_curve(36000.0), "bam_ssmax": perplexity_curve(38000.0)}
    plots.perplexity_vs_position(
        curves,
        dict.fromkeys(curves, 256),
        str(tmp_path / "ppl.png"),
        title="Perplexity by position (pg19 validation)",
    )
    (fig,) = captured
    ax = fig.axes[0]
    assert len(ax.collections) == len(curves)
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels(which="both") if t.get_text()]
    assert labels and all("10^" not in label and "times" not in label for label in labels)
    assert overlapping_texts(fig) == []


@pytest.mark.parametrize("layers", [["all"], [0, 1, 2, 3]])
def test_prior_figure_has_no_overlapping_text(captured, tmp_path: Path, layers: list):
    curves, table = prior_inputs(layers)
    plots.prior_figure(
        curves, table, str(tmp_path / "prior.png"), title="bam: learned priors", train_length=128
    )
    (fig,) = captured
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert ("shared by all layers" in titles) == (layers == ["all"])
    assert all(ax.get_yscale() == "log" for ax in fig.axes[: len(layers)])
    assert overlapping_texts(fig) == []
