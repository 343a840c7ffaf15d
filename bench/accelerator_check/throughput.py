"""b. Attention throughput of each variant, forward and forward+backward."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from bam_jax.attention_spec import AttentionSpec
from bam_jax.blockwise import blockwise_attention
from bam_jax.fused_attention import fused_attention
from bam_jax.priors import AlibiPrior, GGDPrior
from bench.accelerator_check.gate import make_prior
from bench.accelerator_check.report import Deadline, Report, UserError, one_line
from bench.accelerator_check.settings import Settings

TRAINING_RESERVE = 0.3  # share of the deadline kept for the training section
DEFAULT_VARIANTS = (
    "pallas+ggd",
    "pallas",
    "pallas+ggd-table",
    "pallas+ggd-bwdblockwise",
    "blockwise+ggd",
    "cudnn",
    "jax-mha",
    "xla",
)
ALL_VARIANTS = (
    *DEFAULT_VARIANTS,
    "pallas+ggd+ssmax",
    "pallas+alibi",
    "pallas+ggd-exact",
    "pallas+ggd-noreuse",
)


def causal_forward_flops(batch: int, heads: int, length: int, head_dim: int) -> float:
    """QK^T and PV over the causal lower triangle: 2 matmuls x 2 B H T^2 D / 2."""
    return 2.0 * batch * heads * length * length * head_dim


FORWARD_BACKWARD_FACTOR = 3.5  # forward (2 matmuls) + backward (5 matmuls, QK^T recomputed)


def variant_needs_kernel(variant: str) -> bool:
    return variant.startswith("pallas")


def attention_variant(variant: str, settings: Settings) -> Callable:
    """f(q, k, v, prior) -> out for one variant; raises UserError when it cannot run here."""
    if variant == "cudnn":
        if settings.platform != "gpu":
            raise UserError("cuDNN attention needs a GPU")
        return lambda q, k, v, prior: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"
        )
    if variant == "xla":
        return lambda q, k, v, prior: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="xla"
        )
    if variant == "jax-mha":
        return _jax_pallas_mha(settings)
    if variant == "blockwise+ggd":
        spec = AttentionSpec(block_q=settings.block_q, block_k=settings.block_k)
        return lambda q, k, v, prior: blockwise_attention(q, k, v, spec, prior=prior)
    ssmax = jnp.ones((settings.heads,), jnp.float32) if "ssmax" in variant else None
    options = dict(
        ssmax_scale_H=ssmax,
        backend=settings.backend,
        interpret=settings.interpret,
        approx_math="exact" not in variant,
        prior_reuse="noreuse" not in variant,
        prior_table="table" in variant,
        backward="blockwise" if "bwdblockwise" in variant else None,
    )
    spec = AttentionSpec(block_q=settings.block_q, block_k=settings.block_k)
    return lambda q, k, v, prior: fused_attention(q, k, v, spec, prior=prior, **options)


def _jax_pallas_mha(settings: Settings) -> Callable:
    from jax.experimental.pallas.ops.gpu import attention as jax_attention

    if settings.platform != "gpu" and not settings.interpret:
        raise UserError("jax's Pallas mha is a GPU (Triton) kernel")
    # jax's defaults on a GPU; interpret mode needs blocks that divide the smoke lengths.
    block_sizes = jax_attention.BlockSizes(32, 32, 32, 32, 32, 32) if settings.interpret else None
    options = {} if block_sizes is None else {"block_sizes": block_sizes}
    return lambda q, k, v, prior: jax_attention.mha(
        q,
        k,
        v,
        None,
        sm_scale=1.0 / math.sqrt(settings.head_dim),
        causal=True,
        interpret=settings.interpret,
        **options,
    )


def variant_prior(variant: str, heads: int) -> GGDPrior | AlibiPrior | None:
    if "ggd" in variant:
        return make_prior("ggd", heads)
    if "alibi" in variant:
        return make_prior("alibi", heads)
    return None


def forward_backward(attend: Callable) -> Callable:
    """Gradients of sum(out) with respect to q, k, v and the prior parameters."""

    def loss(q, k, v, prior):
        return jnp.sum(attend(q, k, v, prior).astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2, 3))


def time_call(fn: Callable, inputs: tuple, iters: int, max_seconds: float) -> tuple[float, float]:
    """(compile + first call seconds, median seconds of the timed calls)."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*inputs))
    first = time.perf_counter() - start
    times: list[float] = []
    budget_start = time.perf_counter()
    while len(times) < iters and (not times or time.perf_counter() - budget_start < max_seconds):
        start = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def xla_logits_bytes(length: int, heads: int, backward: bool) -> float:
    """The T x T float32 logits and bf16 probabilities that the xla variant materialises."""
    return heads * length * length * (4 + 2) * (3 if backward else 1)


def device_memory_bytes() -> float | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


@dataclasses.dataclass
class ThroughputRun:
    report: Report
    settings: Settings
    deadline: Deadline
    f32_tflops: float
    gate_passed: bool
    seconds: dict[tuple[str, str], tuple[int, float]] = dataclasses.field(default_factory=dict)

    def skip_reason(self, variant: str, length: int, backward: bool) -> str | None:
        if variant_needs_kernel(variant) and not self.gate_passed:
            return "skipped: the gate failed"
        memory = device_memory_bytes()
        needed = xla_logits_bytes(length, self.settings.heads, backward)
        if variant == "xla" and memory and needed > 0.6 * memory:
            return f"skipped: needs ~{needed / 2**30:.0f} GiB of T x T logits"
        reserve = TRAINING_RESERVE * self.deadline.limit_s
        estimate = self.estimate_s(variant, "fwd+bwd" if backward else "fwd", length)
        if self.deadline.remaining() - reserve < estimate:
            return f"skipped: would pass the deadline (~{estimate:.0f} s)"
        return None

    def estimate_s(self, variant: str, pass_name: str, length: int) -> float:
        """Compile allowance plus the timed calls, scaled as T^2 from a shorter length."""
        known = self.seconds.get((variant, pass_name))
        per_call = 0.0 if known is None else known[1] * (length / known[0]) ** 2
        calls = 1 + self.settings.iters
        return self.settings.compile_allowance_s + min(
            calls * per_call, per_call + self.settings.max_seconds_per_row
        )

    def measure(self, variant: str, length: int, backward: bool) -> None:
        s = self.settings
        pass_name = "fwd+bwd" if backward else "fwd"
        cells = (variant, length, s.head_dim, 1, pass_name)
        reason = self.skip_reason(variant, length, backward)
        if reason:
            self.report.row(*cells, "", "", "", "", reason)
            return
        try:
            attend = attention_variant(variant, s)
            fn = jax.jit(forward_backward(attend) if backward else attend)
            keys = jax.random.split(jax.random.key(length), 3)
            shape = (1, length, s.heads, s.head_dim)
            qkv = tuple(jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
            inputs = (*qkv, variant_prior(variant, s.heads))
            first, median = time_call(fn, inputs, s.iters, s.max_seconds_per_row)
        except UserError as error:
            self.report.row(*cells, "", "", "", "", f"skipped: {error}")
            return
        except Exception as error:
            self.report.row(*cells, "", "", "", "", f"failed: {one_line(error)}")
            return
        self.seconds[(variant, pass_name)] = (length, median)
        flops = causal_forward_flops(1, s.heads, length, s.head_dim)
        flops *= FORWARD_BACKWARD_FACTOR if backward else 1.0
        tflops = flops / median / 1e12
        ratio = f"{tflops / self.f32_tflops:.2f}x"
        self.report.row(*cells, f"{median * 1e3:.3g}", f"{tflops:.3g}", ratio, f"{first:.1f}", "")


def run_throughput(run: ThroughputRun, variants: tuple[str, ...]) -> None:
    s = run.settings
    run.report.table(
        f"b. Attention throughput (bf16, causal, batch 1, {s.heads} heads)",
        (
            "variant",
            "T",
            "D",
            "batch",
            "pass",
            "ms",
            "TFLOP/s",
            "vs f32 matmul",
            "compile s",
            "note",
        ),
    )
    for length in s.lengths:
        for backward in (False, True):
            for variant in variants:
                run.measure(variant, length, backward)
