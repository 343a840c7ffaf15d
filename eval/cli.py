"""`bam-eval` (also `python -m eval`): passkey retrieval, perplexity by position, priors.

  bam-eval passkey RUN [RUN ...] --multiples 1,2,4,8,16,32,64,128,256,500
  bam-eval passkey RUN --lengths 0,1k,2k,4k,8k,16k,32k --samples 20 --sampling random
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
from typing import Any

from bam_jax.passkey import SAMPLINGS
from eval import plots
from eval.chunked import capacity_bucket, check_sample_memory
from eval.models import (
    EvalModel,
    activation_bytes,
    cache_bytes_per_slot,
    for_inference,
    load_eval_model,
    make_scorer,
    resolve_tokenizer,
)
from eval.passkey import PasskeySettings, evaluate_passkey
from eval.perplexity import PACKINGS, evaluate_perplexity, load_rows
from eval.prior_inspect import figure_table, head_classes, prior_curves, prior_table
from eval.results import ResultStore
from train.checkpoint import quiet_orphaned_checkpoint_reads

# What the tables and figures read from each stored entry.
PASSKEY_FIELDS = ("target_length", "prompt_length", "accuracy", "depths", "correct")
PERPLEXITY_FIELDS = ("positions", "perplexity")


def parse_count(text: str) -> int:
    """'4096', '4k' (4000), '1.5m' -> int."""
    text = text.strip().lower().replace("_", "")
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a token count like 4096 or 4k, got {text!r}"
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
    parser.add_argument(
        "--step", type=non_negative, default=None, help="checkpoint step (workdirs)"
    )
    parser.add_argument(
        "--tokenizer", default=None, help="mistral, byte, passkey:BASE or a file path"
    )
    parser.add_argument("--out", default="eval_results", help="results and figures folder")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _inference_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunk-size", type=positive, default=512, help="prefill chunk (tokens)")
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

    pk = sub.add_parser("passkey", help="passkey retrieval accuracy vs prompt length")
    _common(pk)
    _inference_options(pk)
    pk.add_argument("--lengths", type=_csv(parse_count), default=None, help="e.g. 0,1k,4k")
    pk.add_argument(
        "--multiples",
        type=_csv(_positive_float),
        default=None,
        help="multiples of each model's training length, e.g. 1,2,4,500",
    )
    pk.add_argument("--samples", type=positive, default=10, help="samples per length")
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

    ppl = sub.add_parser("perplexity", help="perplexity per window of positions")
    _common(ppl)
    _inference_options(ppl)
    ppl.add_argument(
        "--data",
        required=True,
        help="shard dir, .npy, .txt/.jsonl file/dir/glob, hf:NAME[:SUBSET][@SPLIT]",
    )
    ppl.add_argument("--seq-len", type=positive_count, default=32_768)
    ppl.add_argument("--window", type=positive_count, default=1_024)
    ppl.add_argument("--sequences", type=positive, default=16)
    ppl.add_argument("--packing", choices=PACKINGS, default="concat")
    ppl.add_argument("--text-key", default="text")

    pr = sub.add_parser("prior", help="learned priors per layer and head")
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
    try:
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise ValueError(f"--out {args.out!r} is a file, expected a folder for the results")
        models = [load_eval_model(m, step=args.step) for m in args.models]
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must differ, got {names}; name them NAME=PATH")
        if "dtype" in args:
            print(f"compute dtype: {args.dtype} (parameters float32)")
        return {"passkey": run_passkey, "perplexity": run_perplexity, "prior": run_prior}[
            args.command
        ](args, models)
    except ValueError as e:
        print(f"bam-eval: error: {e}", file=sys.stderr)
        return 2


def _scorer(args: argparse.Namespace, m: EvalModel):
    model = for_inference(m.model, block_q=args.block_q, block_k=args.block_k, dtype=args.dtype)
    return make_scorer(model, chunk_size=args.chunk_size), model.config


def _memory_budget(args: argparse.Namespace) -> int:
    return int(args.memory_gb * 2**30)


def _lengths_for(args: argparse.Namespace, m: EvalModel) -> list[int]:
    lengths = list(args.lengths or [])
    lengths += [round(x * m.train_length) for x in args.multiples or []]
    if not lengths:
        raise ValueError("give --lengths and/or --multiples")
    return sorted(set(lengths))


def run_passkey(args: argparse.Namespace, models: list[EvalModel]) -> int:
    tokenizer = resolve_tokenizer(models, args.tokenizer)
    for sampling in args.sampling:
        curves: dict[str, list[dict[str, Any]]] = {}
        for m in models:
            settings = PasskeySettings(
                sampling=sampling,
                n_samples=args.samples,
                prefix_digits=args.prefix_digits,
                seed=args.seed,
                tokenizer=tokenizer.name,
                checkpoint=m.checkpoint,
                dtype=args.dtype,
            )
            scorer, config = _scorer(args, m)
            lengths = _lengths_for(args, m)
            store = ResultStore(
                os.path.join(args.out, m.name, "passkey.json"), m.info(), PASSKEY_FIELDS
            )
            longest = capacity_bucket(max(*lengths, 1), args.chunk_size)
            curves[m.name] = evaluate_passkey(
                scorer,
                tokenizer,
                lengths,
                settings,
                store,
                patience=args.patience,
                batch_size=args.batch_size,
                cache_bytes_per_slot=cache_bytes_per_slot(config),
                activation_bytes=activation_bytes(config, args.chunk_size, longest),
                memory_budget_bytes=_memory_budget(args),
                train_length=m.train_length,
                progress=not args.quiet,
                label=m.name,
            )
            if not args.no_plots:
                plots.depth_heatmap(
                    curves[m.name],
                    os.path.join(args.out, m.name, f"passkey_depth_{sampling}.png"),
                    title=f"{m.name}: passkey accuracy by needle depth ({sampling})",
                )
        print(f"\nPasskey accuracy (%), sampling {sampling}, {args.samples} samples per length")
        print(passkey_table(curves, {m.name: m.train_length for m in models}))
        if not args.no_plots:
            path = plots.accuracy_vs_length(
                curves,
                {m.name: m.train_length for m in models},
                os.path.join(args.out, f"passkey_accuracy_{sampling}.png"),
                title=f"Passkey retrieval ({sampling} needle depths)",
            )
            print(f"figure: {path}")
    print(f"results: {os.path.join(args.out, '<model>', 'passkey.json')}")
    return 0


def passkey_table(curves: dict[str, list[dict[str, Any]]], train_lengths: dict[str, int]) -> str:
    """Rows: models; columns: target lengths (with the multiple of the training length
    when all models share one)."""
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
            + [f"{100 * by_length[n]['accuracy']:.0f}" if n in by_length else "-" for n in lengths]
        )
    return format_table(header, rows)


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_perplexity(args: argparse.Namespace, models: list[EvalModel]) -> int:
    tokenizer = resolve_tokenizer(models, args.tokenizer)
    if args.seq_len % args.window:
        raise ValueError(f"--window {args.window} must divide --seq-len {args.seq_len}")
    scorers = {m.name: _scorer(args, m) for m in models}
    capacity = capacity_bucket(args.seq_len + 1, args.chunk_size)
    for name, (_, config) in scorers.items():
        check_sample_memory(
            f"model {name!r}: perplexity at --seq-len {args.seq_len}",
            capacity,
            cache_bytes_per_slot(config),
            activation_bytes(config, args.chunk_size, capacity),
            _memory_budget(args),
            "use a smaller --seq-len or raise --memory-gb",
        )
    rows = load_rows(
        args.data,
        tokenizer,
        args.seq_len,
        args.sequences,
        packing=args.packing,
        text_key=args.text_key,
    )
    curves: dict[str, dict[str, Any]] = {}
    for m in models:
        settings = {
            "seq_len": args.seq_len,
            "window": args.window,
            "sequences": len(rows),
            "packing": args.packing,
            "tokenizer": tokenizer.name,
            "checkpoint": m.checkpoint,
            "dtype": args.dtype,
        }
        store = ResultStore(
            os.path.join(args.out, m.name, "perplexity.json"), m.info(), PERPLEXITY_FIELDS
        )
        entry = store.get(settings, args.data)
        if entry is None:
            scorer, _ = scorers[m.name]
            entry = evaluate_perplexity(
                scorer,
                rows,
                window=args.window,
                batch_size=args.batch_size or 1,
                progress=not args.quiet,
                label=m.name,
            )
            store.put(settings, args.data, entry)
        curves[m.name] = entry
    header = ["position", *curves]
    positions = next(iter(curves.values()))["positions"]
    table = [
        [str(p)] + [f"{c['perplexity'][i]:.2f}" for c in curves.values()]
        for i, p in enumerate(positions)
    ]
    print(f"\nPerplexity per window of {args.window} positions ({len(rows)} sequences)")
    print(format_table(header, table))
    if not args.no_plots:
        path = plots.perplexity_vs_position(
            curves,
            {m.name: m.train_length for m in models},
            os.path.join(args.out, "perplexity.png"),
        )
        print(f"figure: {path}")
    return 0


def run_prior(args: argparse.Namespace, models: list[EvalModel]) -> int:
    for m in models:
        table = prior_table(m.model, m.config)
        max_distance = args.max_distance or 500 * m.train_length
        curves = prior_curves(m.config, table, max_distance)
        store = ResultStore(os.path.join(args.out, m.name, "prior.json"), m.info())
        store.put({"checkpoint": m.checkpoint}, "heads", {"table": table})
        shown = figure_table(m.config, table)
        print(f"\n{m.name} ({m.config.encoding}): positional parameters")
        print(
            format_table(
                list(shown[0]), [[plots.format_cell(r.get(c)) for c in shown[0]] for r in shown]
            )
        )
        classes = head_classes(m.config, table)
        if classes:
            print(
                f"heads: {classes['local']} local (theta_beta > 0), "
                f"{classes['retrieval']} retrieval (theta_beta <= 0)"
            )
        if not args.no_plots:
            path = plots.prior_figure(
                curves,
                shown,
                os.path.join(args.out, m.name, "prior.png"),
                title=f"{m.name}: learned priors ({m.config.encoding})",
                train_length=m.train_length,
            )
            print(f"figure: {path}")
    return 0
