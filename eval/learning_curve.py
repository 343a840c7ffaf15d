"""A run's learning curve: the zero-shot copy probe (both forms) and passkey accuracy of each
checkpoint it kept, against the tokens it had trained on (`bam-eval curve RUN`). The copy
probe's piece form is the layout of training's copy documents: where it stays at chance, the
model does not copy yet, and no retrieval can be expected of it.

Each checkpoint is scored with `run_copy` and `run_passkey`, so its results also land in
OUT/NAME/copy.json and passkey.json (keyed by the checkpoint) and are not computed again;
the curve itself is OUT/NAME/curve.json, one entry per step, and OUT/NAME/curve.png.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from bam_eval import api, plots, tables
from bam_eval.api import InferenceSettings
from bam_eval.copy_probe import FORMS
from bam_eval.models import parse_model_arg
from bam_jax.io.checkpoints import checkpoint_steps

CURVE_FIELDS = ("step", "tokens", "copy", "passkey")


def trained_tokens(training: dict[str, Any], step: int) -> int:
    """Tokens a run of config `training` (a config.json mapping) has read after `step` steps."""
    per_step = training.get("tokens_per_step") or (
        training["batch_size"] * training["model"]["max_seq_len"]
    )
    return step * per_step


def run_learning_curve(
    run: str,
    *,
    multiples: Sequence[float] = (1.0,),
    samples: int = 20,
    inference: InferenceSettings | None = None,
    out: str | None = None,
    figures: bool = True,
) -> api.Evaluation:
    """`results[name]`: one entry per kept checkpoint of the workdir `run` ([NAME=]PATH),
    with the copy probe's and the passkey's accuracy at each multiple of the training length
    (`inference` None: the default settings)."""
    inference = inference or InferenceSettings()
    name, path, _ = parse_model_arg(run)
    steps = checkpoint_steps(path)
    if not steps:
        raise ValueError(f"model {run!r}: no checkpoints in {path!r} to draw a curve from")
    settings = {
        "multiples": list(multiples),
        "samples": samples,
        "dtype": inference.dtype,
        "copy_forms": list(FORMS),
    }
    points, store = [], None
    for step in steps:
        (model,) = api.load_models([f"{name}={path}@{step}"])
        store = store or api.result_store(out, model, "curve", CURVE_FIELDS)
        point = store.get(settings, str(step))
        if point is None:
            point = _score(model, step, multiples, samples, inference, out)
            store.put(settings, str(step), point)
        points.append(point)
    evaluation = api.Evaluation({name: points})
    if out is not None and figures:
        evaluation.figures.append(
            plots.learning_curve(points, os.path.join(out, name, "curve.png"), title=name)
        )
    return evaluation


def _score(
    model: api.EvalModel,
    step: int,
    multiples: Sequence[float],
    samples: int,
    inference: InferenceSettings,
    out: str | None,
) -> dict[str, Any]:
    copy, piece = (
        api.run_copy(
            [model], multiples=multiples, samples=samples, form=form, inference=inference, out=out
        ).results[model.name]
        for form in FORMS
    )
    passkey = api.run_passkey(
        [model],
        multiples=multiples,
        samples=samples,
        inference=inference,
        out=out,
        figures=False,
        progress=False,
    ).results[model.name]
    return {
        "step": step,
        "tokens": trained_tokens(model.training, step),
        "copy": {_multiple(e, model): e["accuracy"] for e in copy},
        "copy_letters": {_multiple(e, model): e["letter_accuracy"] for e in copy},
        "piece": {_multiple(e, model): e["accuracy"] for e in piece},
        "piece_letters": {_multiple(e, model): e["letter_accuracy"] for e in piece},
        "passkey": {_multiple(e, model): e["accuracy"] for e in passkey},
    }


def _multiple(entry: dict[str, Any], model: api.EvalModel) -> str:
    return f"{entry['target_length'] / model.train_length:g}x"


def curve_table(points: Sequence[dict[str, Any]]) -> str:
    """One row per checkpoint: tokens, then names copied / letters right (%) in the copy
    probe's piece and program forms, and passkey (%)."""
    multiples = list(points[0]["copy"])
    header = ["step", "tokens"]
    header += [f"{form} {m}" for form in ("piece", "copy") for m in multiples]
    header += [f"passkey {m}" for m in multiples]
    rows = [
        [str(p["step"]), f"{p['tokens'] / 1e6:.1f}M"]
        + [
            f"{100 * p[form][m]:.0f} / {100 * p[f'{form}_letters'][m]:.0f}"
            for form in ("piece", "copy")
            for m in multiples
        ]
        + [f"{100 * p['passkey'][m]:.0f}" for m in multiples]
        for p in points
    ]
    return tables.format_table(header, rows)
