"""c. A bf16 training step of the l12_512 preset with each attention implementation."""

from __future__ import annotations

from bench.accelerator_check.report import Deadline, Report, one_line
from bench.accelerator_check.settings import Settings
from bench.accelerator_check.throughput import FORWARD_BACKWARD_FACTOR, causal_forward_flops

TRAINING_IMPLEMENTATIONS = ("fused", "blockwise", "cudnn")


def training_config(implementation: str, settings: Settings):
    """The l12_512 preset in bf16 on passkey data, batch reduced to one device's share."""
    from bam_configs.presets import preset
    from bam_configs.training import DataConfig

    cfg = preset("l12_512")
    model = cfg.model.replace(attention_impl=implementation, dtype="bfloat16")
    if settings.interpret:
        model = model.replace(dim=64, n_layers=2, n_heads=4, max_seq_len=128)
    return cfg.replace(
        model=model,
        data=DataConfig(source="passkey", passkey_loss="all"),
        batch_size=settings.train_batch,
        tokens_per_step=0,
        eval_every=0,
    )


def training_skip_reason(implementation: str, settings: Settings, gate_passed: bool) -> str | None:
    if implementation == "cudnn":
        return (
            "not run: ModelConfig.attention_impl has no cuDNN option "
            "(bam_jax/implementation.py IMPLEMENTATIONS)"
        )
    if implementation == "fused" and not gate_passed:
        return "skipped: the gate failed"
    if implementation == "fused" and settings.interpret:
        return "skipped: the model runs the kernel compiled only (no interpret mode) on GPU/TPU"
    return None


def training_flops(params: int, cfg, tokens: int) -> float:
    """6 N per token for the weights plus the causal attention matmuls, forward+backward."""
    model = cfg.model
    attention = causal_forward_flops(cfg.batch_size, model.n_heads, cfg.seq_len, model.head_dim)
    return 6.0 * params * tokens + FORWARD_BACKWARD_FACTOR * model.n_layers * attention


def measure_training(cfg, deadline: Deadline, steps: int) -> dict[str, float]:
    """bench/train_bench.py's step timing, within the deadline, with the step's TFLOP/s."""
    from bench.train_bench import measure

    result = measure(cfg, steps, seconds_left=deadline.remaining)
    flops = training_flops(result["params"], cfg, cfg.batch_size * cfg.seq_len)
    return {**result, "tflops": flops / result["step_s"] / 1e12}


def run_training(
    report: Report, settings: Settings, deadline: Deadline, f32_tflops: float, gate_passed: bool
) -> None:
    sample = training_config("blockwise", settings)
    model = sample.model
    report.table(
        f"c. Training step: l12_512 preset (dim {model.dim}, {model.n_layers} layers, "
        f"{model.n_heads} heads, bam_ssmax), bf16, passkey data, batch {sample.batch_size} "
        f"x {sample.seq_len} tokens",
        (
            "attention",
            "params",
            "compile s",
            "step ms",
            "tokens/s",
            "TFLOP/s",
            "vs f32 matmul",
            "note",
        ),
    )
    for implementation in TRAINING_IMPLEMENTATIONS:
        reason = training_skip_reason(implementation, settings, gate_passed)
        if reason is None and deadline.remaining() < 6 * settings.compile_allowance_s:
            reason = "skipped: would pass the deadline"
        if reason:
            report.row(implementation, "", "", "", "", "", "", reason)
            continue
        try:
            cfg = training_config(implementation, settings)
            r = measure_training(cfg, deadline, settings.train_steps)
        except Exception as error:
            report.row(implementation, "", "", "", "", "", "", f"failed: {one_line(error)}")
            continue
        report.row(
            implementation,
            f"{r['params'] / 1e6:.1f}M",
            f"{r['compile_s']:.1f}",
            f"{r['step_s'] * 1e3:.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['tflops']:.3g}",
            f"{r['tflops'] / f32_tflops:.2f}x",
            "",
        )
