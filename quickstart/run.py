"""`bam-quickstart`: train a tiny model on synthetic passkey data at a short context on the
CPU, then measure passkey retrieval at multiples of the training length up to 500x. With a
text preset (`--preset stdlib_bytes`), measure instead the perplexity by window of the
training length on held-out files, up to 32x the training length.

The same code paths as a pod run: `bam_train.loop.train` (grain data, optax, orbax
checkpoints) and `bam_eval.api.run_passkey` or `run_perplexity`, what `bam-eval passkey` and
`bam-eval perplexity --packing documents` run (chunked prefill through the KV cache with
blockwise attention). Everything is written under --out: the run (checkpoints,
metrics.jsonl), the results JSON per model and the figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from bam_configs.presets import preset
from bam_configs.training import TrainConfig
from bam_eval import api, tables
from bam_eval import plots as plot_lib
from bam_eval.models import EvalModel
from bam_jax.compilation_cache import add_compilation_cache_argument, use_compilation_cache
from bam_jax.config import Encoding
from bam_jax.io.documents import held_out_source
from bam_jax.logs import log_to_stdout
from bam_train.loop import train
from bam_train.signals import INTERRUPTED_STATUS

DEFAULT_MULTIPLES = "1,2,4,8,16,32,64,128,256,500"
PERPLEXITY_MULTIPLES = "1,2,4,8,16,32"
PASSKEY_SAMPLES = 20
PERPLEXITY_SEQUENCES = 32
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
    `ModelConfig.dilation_problem` says why not elsewhere). The prior's options
    (its initialisation, one prior or one per layer, `optim.prior_lr`) only exist for BAM.
    """
    cfg = preset(preset_name)
    ssmax = Encoding.parse(encoding, field="--encodings").ssmax
    model = cfg.model.replace(
        encoding=encoding, ssmax_capped_layers=cfg.model.ssmax_capped_layers if ssmax else 0
    )
    jitter = ssmax and any(model.ssmax_growing_layers())
    cfg = cfg.replace(
        model=model,
        seed=seed,
        ssmax_jitter=cfg.ssmax_jitter if jitter else 0.0,
        prior_dilation=1.0 if model.dilation_problem() else cfg.prior_dilation,
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
    parser.add_argument(
        "--multiples",
        default=None,
        help="evaluation lengths in multiples of the training length (passkey default "
        f"{DEFAULT_MULTIPLES}); text presets: perplexity over sequences of the largest, by "
        f"window of the training length, tabled at each (default {PERPLEXITY_MULTIPLES})",
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=None,
        help=f"passkey samples per length (default {PASSKEY_SAMPLES}); text presets: "
        f"held-out files evaluated, one sequence each (default {PERPLEXITY_SEQUENCES})",
    )
    parser.add_argument("--no-plots", action="store_true")
    add_compilation_cache_argument(parser)
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
    multiples: str | None = None,
    samples: int | None = None,
    plots: bool = True,
    preset_name: str = "quickstart",
    seeds: Sequence[int] = (0,),
    patience: int | None = None,
    fresh: bool = False,
) -> int:
    """Train one run per encoding and seed (resuming finished ones), then evaluate them
    together (with `fresh`, dropping the results files' earlier runs): passkey retrieval
    for passkey presets, perplexity on the corpus's held-out files for text presets; with
    several seeds, also the mean and range over each encoding's seeds."""
    cfg = preset(preset_name)
    held_out = None if cfg.data.source == "passkey" else held_out_source(cfg.data.path)
    default_multiples = DEFAULT_MULTIPLES if held_out is None else PERPLEXITY_MULTIPLES
    lengths = _multiples(multiples or default_multiples)
    if held_out is not None:
        check_perplexity_multiples(lengths)
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
    if held_out is not None:
        evaluate_perplexity(
            models,
            groups,
            held_out,
            lengths,
            samples or PERPLEXITY_SEQUENCES,
            out,
            plots,
            fresh,
        )
        return 0
    samples = samples or PASSKEY_SAMPLES
    evaluation = api.run_passkey(
        models,
        multiples=lengths,
        samples=samples,
        patience=patience,
        out=out,
        figures=plots,
        fresh=fresh,
    )
    print(f"\nPasskey accuracy (%), sampling equidistant, {samples} samples per length")
    print(tables.passkey_table(evaluation.results, {m.name: m.train_length for m in models}))
    for path in evaluation.figures[-1:]:
        print(f"figure: {path}")
    if len(seeds) > 1:
        print_seed_summary(evaluation.results, groups, models[0].train_length, out, plots)
    return 0


def _multiples(text: str) -> list[float]:
    return [float(m) for m in text.split(",") if m.strip()]


def check_perplexity_multiples(multiples: Sequence[float]) -> None:
    """Perplexity windows are whole training lengths: the multiples must be whole numbers."""
    if not multiples or any(m < 1 or m != int(m) for m in multiples):
        raise ValueError(
            "--multiples: a text preset's perplexity is measured by window of the training "
            f"length, so expected whole multiples >= 1 such as {PERPLEXITY_MULTIPLES}, got "
            f"{list(multiples)}"
        )


def evaluate_perplexity(
    models: Sequence[EvalModel],
    groups: dict[str, list[str]],
    data: str,
    multiples: Sequence[float],
    sequences: int,
    out: str,
    plots: bool,
    fresh: bool,
) -> None:
    """Perplexity by window of the training length over `sequences` held-out documents of
    max(multiples) training lengths each (`bam-eval perplexity --packing documents`); the
    tables (and OUT/perplexity_windows.txt, or perplexity_windows_seeds.txt when a group
    has several runs, like the figure perplexity_by_window[_seeds].png) show the windows
    ending at each multiple, mean and range over each group's runs."""
    train_length = models[0].train_length
    evaluation = api.run_perplexity(
        models,
        data,
        seq_len=int(max(multiples) * train_length),
        window=train_length,
        sequences=sequences,
        packing="documents",
        out=out,
        figures=plots,
        fresh=fresh,
    )
    spread = tables.perplexity_spread(evaluation.results, groups)
    n_sequences = next(iter(evaluation.results.values()))["n_sequences"]
    positions = [int(m) * train_length for m in multiples]
    sections = [
        f"{kind} per window of {train_length} tokens ending at each position, {n_sequences} "
        f"held-out sequences of {data}; mean [lowest-highest] over each encoding's "
        f"{len(next(iter(groups.values())))} run(s)\n"
        + tables.perplexity_seed_table(spread, train_length, positions, perplexity=ppl)
        for kind, ppl in (("Loss (nats per token)", False), ("Perplexity", True))
    ]
    text = "\n\n".join(sections)
    print(f"\n{text}")
    suffix = "_seeds" if any(len(names) > 1 for names in groups.values()) else ""
    with open(os.path.join(out, f"perplexity_windows{suffix}.txt"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    if plots:
        path = plot_lib.perplexity_band(
            spread,
            train_length,
            os.path.join(out, f"perplexity_by_window{suffix}.png"),
            title=f"Perplexity by window of {train_length} tokens, {data}",
        )
        print(f"figure: {path}")


def print_seed_summary(
    results: dict, groups: dict[str, list[str]], train_length: int, out: str, plots: bool
) -> None:
    seeds = len(next(iter(groups.values())))
    print(f"\nOver {seeds} seeds: mean accuracy (%) [lowest-highest seed]")
    print(tables.seed_summary(results, groups, train_length))
    if plots:
        path = plot_lib.accuracy_band(
            tables.accuracy_spread(results, groups),
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
        use_compilation_cache(args.compilation_cache)
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
