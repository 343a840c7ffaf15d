"""`bam-eval` (also `python -m bam_eval`): passkey retrieval, copying, perplexity by position,
priors.

  bam-eval passkey RUN [RUN ...] --multiples 1,2,4,8,16,32,64,128,256,500
  bam-eval passkey RUN --lengths 0,1k,2k,4k,8k,16k,32k --samples 20 --sampling random
  bam-eval retrieval RUN --task multikey --needles 4 --multiples 1,8,64,500
  bam-eval copy RUN --multiples 1,2,4,16,64,500 --samples 20
  bam-eval curve WORKDIR --multiples 1,4      (every kept checkpoint, against tokens seen)

Token counts take k = 1024 and m = 1024**2 (4k = 4096).
  bam-eval perplexity RUN [RUN ...] --data held_out.jsonl --seq-len 32768 --window 1024
  bam-eval prior RUN [RUN ...]

A RUN is a training workdir (latest checkpoint; PATH@STEP or --step for another) or a
reference run directory (args.json + model.pt), optionally named: NAME=PATH. Results go to
--out (one JSON per model and task, extended by later runs) with the figures.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

from bam_eval import api, plots, tables
from bam_eval.copy_probe import FORMS
from bam_eval.learning_curve import curve_table, run_learning_curve
from bam_eval.models import EvalModel
from bam_eval.perplexity import PACKINGS
from bam_jax.compilation_cache import add_compilation_cache_argument, use_compilation_cache
from bam_jax.implementation import IMPLEMENTATION_CHOICES
from bam_jax.io.checkpoints import quiet_orphaned_checkpoint_reads
from bam_jax.io.documents import STDLIB_HELD_OUT
from bam_jax.logs import log_to_stdout
from bam_jax.passkey import SAMPLINGS
from bam_jax.retrieval import DEFAULT_NEEDLES, TASKS, RetrievalTask


def parse_count(text: str) -> int:
    """'4096', '4k' (4096), '1.5m' (1.5 x 2**20) -> int: token counts are binary."""
    text = text.strip().lower().replace("_", "")
    scale = {"k": 1024, "m": 1024**2}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a token count like 4096 or 4k (= 4096), got {text!r}"
        ) from None
    if value < 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"expected a whole token count >= 0, got {text!r}")
    return int(value)


def positive_count(text: str) -> int:
    """parse_count, but at least 1."""
    value = parse_count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a token count >= 1, got {text!r}")
    return value


def _csv(kind):
    def parse(text: str) -> list:
        return [kind(part) for part in text.split(",") if part.strip()]

    return parse


def _integer(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a number >= {minimum}, got {text!r}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def _sampling(text: str) -> str:
    if text not in SAMPLINGS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(SAMPLINGS)}, got {text!r}")
    return text


positive = _integer(1)
non_negative = _integer(0)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="+", metavar="RUN", help="[NAME=]PATH[@STEP]")
    add_compilation_cache_argument(parser)
    parser.add_argument(
        "--step", type=non_negative, default=None, help="checkpoint step (workdirs)"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="mistral, byte, passkey:BASE, hf:NAME or a path, for every RUN (default: the "
        "tokenizer each RUN was trained with)",
    )
    parser.add_argument("--out", default="eval_results", help="results and figures folder")
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="start each model's results file anew, without its earlier runs (the old file "
        "is replaced when the first new result is written)",
    )
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--quiet", action="store_true", help="no progress (bars on a terminal, else log lines)"
    )


def _length_options(parser: argparse.ArgumentParser, *, samples: int) -> None:
    """The prompt lengths of a sweep (absolute, or multiples of each model's training
    length) and its samples per length."""
    parser.add_argument("--lengths", type=_csv(parse_count), default=None, help="e.g. 0,1k,4k")
    parser.add_argument(
        "--multiples",
        type=_csv(_positive_float),
        default=None,
        help="multiples of each model's training length, e.g. 1,2,4,500",
    )
    parser.add_argument("--samples", type=positive, default=samples, help="samples per length")


def _inference_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunk-size", type=positive, default=512, help="prefill chunk (tokens)")
    parser.add_argument(
        "--attention",
        choices=IMPLEMENTATION_CHOICES,
        default="auto",
        help="attention implementation (default auto: the fused kernel on CPU where its build "
        "has AVX-512 and BAM_JAX_CPU_KERNEL does not turn it off, else blockwise; the fused "
        "kernel on validated GPUs and TPUs; pallas is fused's earlier name)",
    )
    parser.add_argument("--block-q", type=positive, default=None, help="attention query block")
    parser.add_argument("--block-k", type=positive, default=None, help="attention key block")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="compute dtype, whatever the model was trained in (default float32; bfloat16 "
        "multiplies in bfloat16 and keeps the residual stream, softmax and logits float32)",
    )
    parser.add_argument("--batch-size", type=positive, default=None, help="default: by memory")
    parser.add_argument(
        "--memory-gb",
        type=_positive_float,
        default=4.0,
        help="memory budget of a batch (KV cache and activations); longer samples are refused",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bam-eval", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    defaults_shown = {"formatter_class": argparse.ArgumentDefaultsHelpFormatter}

    pk = sub.add_parser(
        "passkey",
        aliases=["retrieval"],
        help="passkey (or another retrieval task's) accuracy vs prompt length",
        **defaults_shown,
    )
    _common(pk)
    _inference_options(pk)
    _length_options(pk, samples=10)
    pk.add_argument(
        "--sampling",
        type=_csv(_sampling),
        default=["equidistant"],
        help=f"needle depth rule(s): {', '.join(SAMPLINGS)}",
    )
    pk.add_argument(
        "--prefix-digits", type=non_negative, default=1, help="given key digits (paper: 1)"
    )
    pk.add_argument("--patience", type=positive, default=None, help="stop after N lengths at 0%%")
    pk.add_argument("--seed", type=non_negative, default=0)
    pk.add_argument(
        "--task",
        choices=TASKS,
        default="passkey",
        help="multikey: one of N keys asked; multivalue: all N values of one key; "
        "vartrack: a chain of N assignments",
    )
    pk.add_argument(
        "--needles",
        type=positive,
        default=DEFAULT_NEEDLES,
        help="keys, values or assignments per prompt (not passkey)",
    )

    cp = sub.add_parser(
        "copy",
        help="long-range copy probe: a random name defined once in held-out text, asked again",
        **defaults_shown,
    )
    _common(cp)
    _inference_options(cp)
    _length_options(cp, samples=20)
    cp.add_argument(
        "--sampling", type=_sampling, default="equidistant", help="definition depth rule"
    )
    cp.add_argument(
        "--data",
        default=STDLIB_HELD_OUT,
        help="the text around the name: .txt/.jsonl file/dir/glob, hf:NAME, or "
        "python-stdlib:held-out",
    )
    cp.add_argument(
        "--form",
        choices=FORMS,
        default="program",
        help="program: `NAME = None` ... `print(NA`; piece: the name alone on a line, then "
        "its first letters on a new line (the layout of training's copy documents)",
    )
    cp.add_argument("--seed", type=non_negative, default=0)

    curve = sub.add_parser(
        "curve",
        help="learning curve: copy probe and passkey accuracy of each checkpoint of a run",
        **defaults_shown,
    )
    curve.add_argument("models", nargs=1, metavar="RUN", help="[NAME=]WORKDIR")
    add_compilation_cache_argument(curve)
    curve.add_argument("--out", default="eval_results", help="results and figures folder")
    curve.add_argument("--no-plots", action="store_true")
    _inference_options(curve)
    curve.add_argument(
        "--multiples",
        type=_csv(_positive_float),
        default=[1.0],
        help="multiples of the training length, e.g. 1,4",
    )
    curve.add_argument("--samples", type=positive, default=20, help="samples per length")

    ppl = sub.add_parser("perplexity", help="perplexity per window of positions", **defaults_shown)
    _common(ppl)
    _inference_options(ppl)
    ppl.add_argument(
        "--data",
        required=True,
        help="shard dir, .npy, .txt/.jsonl file/dir/glob, hf:NAME[:SUBSET][@SPLIT], "
        "python-stdlib:held-out (the standard library files held out of python-stdlib)",
    )
    ppl.add_argument("--seq-len", type=positive_count, default=32_768)
    ppl.add_argument("--window", type=positive_count, default=1_024)
    ppl.add_argument("--sequences", type=positive, default=16)
    ppl.add_argument("--packing", choices=PACKINGS, default="concat")
    ppl.add_argument("--text-key", default="text")

    pr = sub.add_parser("prior", help="learned priors per layer and head", **defaults_shown)
    _common(pr)
    pr.add_argument(
        "--max-distance",
        type=positive_count,
        default=None,
        help="largest distance plotted (default 500x the training length)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_orphaned_checkpoint_reads()
    log_to_stdout()
    try:
        check_arguments(args)
        use_compilation_cache(args.compilation_cache)
        if args.command == "curve":
            return curve(args)
        models = api.load_models(args.models, step=args.step)
        if "dtype" in args:
            print(f"compute dtype: {args.dtype} (parameters float32)")
        commands = {"passkey": passkey, "retrieval": passkey, "copy": copy}
        return {**commands, "perplexity": perplexity, "prior": prior}[args.command](args, models)
    except ValueError as e:
        print(f"bam-eval: error: {e}", file=sys.stderr)
        return 2


def check_arguments(args: argparse.Namespace) -> None:
    """What can be checked before any model loads."""
    api.check_out_folder(args.out)
    if args.command in ("passkey", "retrieval", "copy") and not (args.lengths or args.multiples):
        raise ValueError("give --lengths and/or --multiples")
    if args.command in ("passkey", "retrieval"):
        RetrievalTask(args.task, args.needles)
    if args.command == "perplexity":
        api.check_perplexity_window(args.seq_len, args.window)


def _inference(args: argparse.Namespace) -> api.InferenceSettings:
    return api.InferenceSettings(
        chunk_size=args.chunk_size,
        attention=args.attention,
        block_q=args.block_q,
        block_k=args.block_k,
        dtype=args.dtype,
        batch_size=args.batch_size,
        memory_gb=args.memory_gb,
    )


def _print_figures(figures: list[str]) -> None:
    for path in figures:
        print(f"figure: {path}")


def passkey(args: argparse.Namespace, models: list[EvalModel]) -> int:
    train_lengths = {m.name: m.train_length for m in models}
    for i, sampling in enumerate(args.sampling):
        evaluation = api.run_passkey(
            models,
            lengths=args.lengths or (),
            multiples=args.multiples or (),
            samples=args.samples,
            sampling=sampling,
            prefix_digits=args.prefix_digits,
            patience=args.patience,
            seed=args.seed,
            tokenizer=args.tokenizer,
            inference=_inference(args),
            out=args.out,
            figures=not args.no_plots,
            progress=not args.quiet,
            task=args.task,
            needles=args.needles,
            # One file holds every sampling's runs: only the first starts it anew.
            fresh=args.fresh and i == 0,
        )
        name = "Passkey" if args.task == "passkey" else f"{args.task} ({args.needles} needles)"
        print(f"\n{name} accuracy (%), sampling {sampling}, {args.samples} samples per length")
        print(tables.passkey_table(evaluation.results, train_lengths))
        _print_figures(evaluation.figures[-1:])
    for m in models:
        print(f"results: {os.path.join(args.out, m.name, 'passkey.json')}")
    return 0


def copy(args: argparse.Namespace, models: list[EvalModel]) -> int:
    evaluation = api.run_copy(
        models,
        lengths=args.lengths or (),
        multiples=args.multiples or (),
        samples=args.samples,
        sampling=args.sampling,
        data=args.data,
        form=args.form,
        seed=args.seed,
        tokenizer=args.tokenizer,
        inference=_inference(args),
        out=args.out,
        fresh=args.fresh,
    )
    train_lengths = {m.name: m.train_length for m in models}
    print(
        f"\nCopy probe ({args.form} form): names copied exactly / letters right (%), "
        f"{args.samples} samples"
    )
    print(tables.copy_table(evaluation.results, train_lengths))
    for m in models:
        print(f"results: {os.path.join(args.out, m.name, 'copy.json')}")
    return 0


def curve(args: argparse.Namespace) -> int:
    evaluation = run_learning_curve(
        args.models[0],
        multiples=args.multiples,
        samples=args.samples,
        inference=_inference(args),
        out=args.out,
        figures=not args.no_plots,
    )
    ((name, points),) = evaluation.results.items()
    print(f"\nLearning curve of {name}: names copied / letters right, passkeys (%)")
    print(curve_table(points))
    _print_figures(evaluation.figures)
    print(f"results: {os.path.join(args.out, name, 'curve.json')}")
    return 0


def perplexity(args: argparse.Namespace, models: list[EvalModel]) -> int:
    evaluation = api.run_perplexity(
        models,
        args.data,
        seq_len=args.seq_len,
        window=args.window,
        sequences=args.sequences,
        packing=args.packing,
        text_key=args.text_key,
        tokenizer=args.tokenizer,
        inference=_inference(args),
        out=args.out,
        figures=not args.no_plots,
        progress=not args.quiet,
        fresh=args.fresh,
    )
    n_sequences = next(iter(evaluation.results.values()))["n_sequences"]
    print(f"\nPerplexity per window of {args.window} positions ({n_sequences} sequences)")
    print(tables.perplexity_table(evaluation.results))
    _print_figures(evaluation.figures)
    return 0


def prior(args: argparse.Namespace, models: list[EvalModel]) -> int:
    evaluation = api.run_prior(
        models,
        max_distance=args.max_distance,
        out=args.out,
        figures=not args.no_plots,
        fresh=args.fresh,
    )
    for m in models:
        result = evaluation.results[m.name]
        shown = result["shown"]
        print(f"\n{m.name} ({m.config.encoding}): positional parameters")
        print(
            tables.format_table(
                list(shown[0]), [[plots.format_cell(r.get(c)) for c in shown[0]] for r in shown]
            )
        )
        classes = result["classes"]
        if classes:
            print(
                f"heads: {classes['local']} local (theta_beta > 0), "
                f"{classes['retrieval']} retrieval (theta_beta <= 0)"
            )
    _print_figures(evaluation.figures)
    return 0
