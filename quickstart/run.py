"""`bam-quickstart`: train a tiny model on synthetic passkey data at a short context on the
CPU, then measure passkey retrieval at multiples of the training length up to 500x.

The same code paths as a pod run: `bam_train.loop.train` (grain data, optax, orbax
checkpoints) and `bam_eval.api.run_passkey`, what `bam-eval passkey` runs (chunked prefill
through the KV cache with blockwise attention). Everything is written under --out: the run
(checkpoints, metrics.jsonl), the results JSON per model and the figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from bam_configs.presets import preset
from bam_eval import api
from bam_eval import plots as plot_lib
from bam_jax.logs import log_to_stdout
from bam_train.config import TrainConfig, prior_dilation_problem
from bam_train.loop import train
from bam_train.signals import INTERRUPTED_STATUS

DEFAULT_MULTIPLES = "1,2,4,8,16,32,64,128,256,500"
COMPARE_ENCODINGS = "nope,rope,alibi,bam,nope_ssmax,rope_ssmax,alibi_ssmax,bam_ssmax"


def quickstart_config(
    encoding: str = "bam_ssmax",
    steps: int | None = None,
    preset_name: str = "quickstart",
    seed: int = 0,
) -> TrainConfig:
    """A preset (default `quickstart`) with another encoding, step count or seed (the seed
    draws the model's initialisation and the training data).

    Every encoding gets each of the preset's options that has an analogue for it and drops
    the others: the SSMax cap (`ssmax_capped_layers`) and jitter (`ssmax_jitter`) go to
    every SSMax encoding (the jitter only where some layer's SSMax count grows with the
    prompt); the prior dilation (`prior_dilation`) to every encoding with positions to
    stretch in a global layer (BAM, ALiBi, RoPE, and sinusoidal without local layers;
    `bam_train.config.prior_dilation_problem` says why not elsewhere). The prior's options
    (its initialisation, one prior or one per layer, `optim.prior_lr`) only exist for BAM.
    """
    cfg = preset(preset_name)
    ssmax = encoding.endswith("_ssmax")
    model = cfg.model.replace(
        encoding=encoding, ssmax_capped_layers=cfg.model.ssmax_capped_layers if ssmax else 0
    )
    jitter = ssmax and any(model.ssmax_growing_layers())
    cfg = cfg.replace(
        model=model,
        seed=seed,
        ssmax_jitter=cfg.ssmax_jitter if jitter else 0.0,
        prior_dilation=1.0 if prior_dilation_problem(model) else cfg.prior_dilation,
    )
    return cfg if steps is None else cfg.replace(steps=steps)


def run_name(encoding: str, seed: int) -> str:
    """The run's folder under runs/ and its name in tables: seed 0 keeps the bare encoding."""
    return encoding if seed == 0 else f"{encoding}_seed{seed}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bam-quickstart", description=__doc__)
    parser.add_argument("--out", default="results/quickstart", help="output folder")
    parser.add_argument(
        "--encodings",
        default="bam_ssmax",
        help="comma-separated encodings, each trained and evaluated side by side "
        f"(compare: {COMPARE_ENCODINGS})",
    )
    parser.add_argument(
        "--preset",
        default="quickstart",
        help="training preset of every run (configs/presets.py; e.g. quickstart_paper, the "
        "paper's protocol at the quick start's scale)",
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps")
    parser.add_argument(
        "--seed",
        type=_seeds,
        default=[0],
        help="model initialisation and training data (evaluation samples stay the same); "
        "several, e.g. 0,1,2, train each encoding once per seed and add a table and a "
        "figure of the mean and range over seeds",
    )
    parser.add_argument(
        "--patience",
        type=int,
        default=None,
        help="stop a model's sweep after N consecutive lengths at 0%%",
    )
    parser.add_argument("--multiples", default=DEFAULT_MULTIPLES, help="evaluation lengths")
    parser.add_argument("--samples", type=int, default=20, help="passkey samples per length")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="start each model's passkey.json anew, without its earlier runs (training "
        "still resumes the runs under OUT/runs)",
    )
    return parser


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seeds like 0 or 0,1,2, got {text!r}") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"expected distinct seeds >= 0, got {text!r}")
    return seeds


def train_and_evaluate(
    encodings: Sequence[str],
    out: str,
    *,
    steps: int | None,
    multiples: str,
    samples: int,
    plots: bool = True,
    preset_name: str = "quickstart",
    seeds: Sequence[int] = (0,),
    patience: int | None = None,
    fresh: bool = False,
) -> int:
    """Train one run per encoding and seed (resuming finished ones), then evaluate them
    together (with `fresh`, dropping the results files' earlier runs); with several seeds,
    also the mean and range over each encoding's seeds."""
    runs, groups = [], {}
    for encoding in encodings:
        for seed in seeds:
            name = run_name(encoding, seed)
            workdir = os.path.join(out, "runs", name)
            start = time.perf_counter()
            result = train(quickstart_config(encoding, steps, preset_name, seed), workdir)
            if result.preempted or result.interrupted:
                by = "SIGTERM" if result.preempted else "Ctrl-C"
                print(
                    f"{name}: stopped by {by} at step {result.step}, saved in {workdir}; "
                    "nothing evaluated (the same command resumes)"
                )
                return INTERRUPTED_STATUS if result.interrupted else 0
            print(f"{name}: trained in {time.perf_counter() - start:.0f} s ({workdir})")
            runs.append(f"{name}={workdir}")
            groups.setdefault(encoding, []).append(name)
    models = api.load_models(runs)
    evaluation = api.run_passkey(
        models,
        multiples=[float(m) for m in multiples.split(",") if m.strip()],
        samples=samples,
        patience=patience,
        out=out,
        figures=plots,
        fresh=fresh,
    )
    print(f"\nPasskey accuracy (%), sampling equidistant, {samples} samples per length")
    print(api.passkey_table(evaluation.results, {m.name: m.train_length for m in models}))
    for path in evaluation.figures[-1:]:
        print(f"figure: {path}")
    if len(seeds) > 1:
        print_seed_summary(evaluation.results, groups, models[0].train_length, out, plots)
    return 0


def print_seed_summary(
    results: dict, groups: dict[str, list[str]], train_length: int, out: str, plots: bool
) -> None:
    seeds = len(next(iter(groups.values())))
    print(f"\nOver {seeds} seeds: mean accuracy (%) [lowest-highest seed]")
    print(api.seed_summary(results, groups, train_length))
    if plots:
        path = plot_lib.accuracy_band(
            api.accuracy_spread(results, groups),
            train_length,
            os.path.join(out, "passkey_accuracy_seeds_equidistant.png"),
            title="Passkey retrieval over seeds (equidistant needle depths)",
        )
        print(f"figure: {path}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log_to_stdout()
    start = time.perf_counter()
    try:
        status = train_and_evaluate(
            [e.strip() for e in args.encodings.split(",") if e.strip()],
            args.out,
            steps=args.steps,
            multiples=args.multiples,
            samples=args.samples,
            plots=not args.no_plots,
            preset_name=args.preset,
            seeds=args.seed,
            patience=args.patience,
            fresh=args.fresh,
        )
    except ValueError as e:
        print(f"bam-quickstart: error: {e}", file=sys.stderr)
        return 2
    print(f"quick start finished in {time.perf_counter() - start:.0f} s")
    return status
