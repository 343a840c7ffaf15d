"""Accelerator check: the fused Pallas kernel's gate, attention throughput, a training step.

    python -m bench.accelerator_check            # one GPU, under 8 minutes
    python -m bench.accelerator_check --smoke    # CPU, tiny sizes, ~1.5 min

Four sections, each row appended to the markdown table (`--out`, default
results/accelerator_check/DEVICE-DATE.md) as soon as it is measured, so a run cut short
still leaves its table:

a. gate: the Pallas kernel against the float32 reference (matmul precision "highest", so
   no TF32) at shapes that cover the unmasked loop (no documents), documents and padding,
   lengths that are not a multiple of the block, SSMax inside and outside the prior, GQA,
   negative theta_beta, a query offset, no prior, the prior table, a steep learned prior
   under SSMax deep in a KV cache; values in float32 and bfloat16, and the gradients
   of q, k, v, the prior parameters and the SSMax scales (thresholds: GATE_THRESHOLDS).
   If any check fails the run prints FAIL, skips every row that runs the kernel and exits
   with status 1.
b. throughput: forward and forward+backward TFLOP/s of each attention variant at 16k, 32k
   and 128k tokens, the most important first (batch 1, 16 heads, head dim 128, bf16,
   causal). FLOPs are the causal matmul
   FLOPs: forward 2 * B * H * T^2 * D (QK^T and PV over the lower triangle), backward 2.5x
   that (five matmuls, QK^T recomputed), so forward+backward 3.5x; the prior's elementwise
   work is not counted.
c. training: the step time and tokens/s of a bf16 training step of the l12_512 preset
   (passkey data, batch reduced to fit one device) with each attention implementation.
d. autotune (only with `--sections autotune`): the GGD forward at the first length over
   GPU block sizes, warps and stages (AUTOTUNE_GRID), fastest first, ending with the
   GPU_DEFAULTS entry to copy into bam_jax/kernels/gpu.py.

The float32 matmul rate (precision "highest") is measured first; every timed row shows
its ratio to it. A global deadline (`--deadline-s`) skips rows that would pass it and
stops the run at it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import math
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from itertools import product
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bam_jax.attention import reference_attention
from bam_jax.attention_spec import AttentionSpec
from bam_jax.blockwise import blockwise_attention
from bam_jax.implementation import FUSED_VALIDATED_DEVICES
from bam_jax.masking import AttentionMask, visibility_mask
from bam_jax.pallas_attention import pallas_attention
from bam_jax.priors import AlibiPrior, GGDPrior, alibi_slopes

DEFAULT_DEADLINE_S = 450.0
DEFAULT_LENGTHS = (16384, 32768, 131072)
DEFAULT_HEAD_DIM = 128
TRAINING_RESERVE = 0.3  # share of the deadline kept for the training section
GATE_THRESHOLDS = {
    # max |kernel - reference|; the kernel's own dots may use TF32 or approximate exp2
    "values float32": 2e-3,
    # the bf16 input tolerance of tests/kernels/test_pallas_attention.py
    "values bfloat16": 3e-2,
    # max |kernel - reference| / max(1, max |reference|), per gradient
    "gradient": 1e-2,
}
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
SECTIONS = ("gate", "throughput", "training", "autotune")
DEFAULT_SECTIONS = ("gate", "throughput", "training")
AUTOTUNE_GRID = {
    "block_q": (64, 128, 256),
    "block_k": (32, 64, 128),
    "num_warps": (4, 8),
    "num_stages": (2, 3),
}
TRAINING_IMPLEMENTATIONS = ("fused", "blockwise", "cudnn")


class UserError(Exception):
    """A bad flag or an unsuitable machine: printed as one line, exit status 2."""


# ---------------------------------------------------------------------------------------
# Report and deadline


@dataclasses.dataclass
class Report:
    """Markdown lines, printed and written to `path` after every addition."""

    path: Path
    lines: list[str] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def add(self, *lines: str) -> None:
        with self.lock:
            self.lines.extend(lines)
            print("\n".join(lines), flush=True)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(self.path.name + ".partial")
            partial.write_text("\n".join(self.lines) + "\n")
            os.replace(partial, self.path)

    def table(self, title: str, columns: tuple[str, ...]) -> None:
        self.add(
            "", f"## {title}", "", "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"
        )

    def row(self, *cells: object) -> None:
        self.add("| " + " | ".join(_cell(c) for c in cells) + " |")


def _cell(value: object) -> str:
    text = f"{value:.3g}" if isinstance(value, float) else str(value)
    return text.replace("|", "/").replace("\n", " ")


@dataclasses.dataclass
class Deadline:
    limit_s: float
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def remaining(self) -> float:
        return self.limit_s - (time.perf_counter() - self.start)


def stop_at_deadline(report: Report, deadline: Deadline) -> threading.Timer:
    """Ends the process at the deadline, even inside a call, after noting it in the table."""

    def stop() -> None:
        report.add("", f"STOPPED: the deadline of {deadline.limit_s:.0f} s was reached.")
        os._exit(3)

    timer = threading.Timer(max(deadline.remaining(), 0.0), stop)
    timer.daemon = True
    timer.start()
    return timer


def one_line(error: BaseException, limit: int = 200) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ")
    return text[:limit]


# ---------------------------------------------------------------------------------------
# Settings: full size on an accelerator, tiny with --smoke


@dataclasses.dataclass(frozen=True)
class Settings:
    backend: str  # "gpu" or "tpu": the kernel's lowering
    interpret: bool  # Pallas interpret mode (CPU smoke run)
    platform: str
    lengths: tuple[int, ...]
    heads: int
    head_dim: int
    iters: int
    max_seconds_per_row: float
    compile_allowance_s: float
    block_q: int | None
    block_k: int | None
    train_batch: int
    train_steps: int


def make_settings(args: argparse.Namespace) -> Settings:
    platform = jax.default_backend()
    if args.smoke:
        return Settings(
            backend="gpu",
            interpret=True,
            platform=platform,
            lengths=tuple(args.lengths or (64,)),
            heads=2,
            head_dim=args.head_dim or 32,
            iters=1,
            max_seconds_per_row=5.0,
            compile_allowance_s=2.0,
            block_q=32,
            block_k=16,
            train_batch=2,
            train_steps=2,
        )
    if platform not in ("gpu", "tpu"):
        raise UserError(
            f"no GPU or TPU found (JAX backend is {platform!r}); run on an accelerator, "
            "or pass --smoke for a tiny CPU run that proves the script works"
        )
    return Settings(
        backend=platform,
        interpret=False,
        platform=platform,
        lengths=tuple(args.lengths or DEFAULT_LENGTHS),
        heads=16,
        head_dim=args.head_dim or DEFAULT_HEAD_DIM,
        iters=args.iters,
        max_seconds_per_row=20.0,
        compile_allowance_s=15.0,
        block_q=None,
        block_k=None,
        train_batch=args.train_batch,
        train_steps=5,
    )


def device_kind() -> str:
    return jax.devices()[0].device_kind


def default_out_path(today: datetime.date) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", device_kind()).strip("-") or "device"
    return Path("results/accelerator_check") / f"{name}-{today.isoformat()}.md"


# ---------------------------------------------------------------------------------------
# Machine rate


def matmul_tflops(dtype: jnp.dtype, n: int, repeats: int = 5) -> float:
    """n x n matmul rate at precision "highest" (true float32 for float32 inputs)."""
    a = jnp.ones((n, n), dtype)
    with jax.default_matmul_precision("highest"):
        matmul = jax.jit(lambda x: x @ x)
        jax.block_until_ready(matmul(a))
        start = time.perf_counter()
        for _ in range(repeats):
            jax.block_until_ready(matmul(a))
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


# ---------------------------------------------------------------------------------------
# a. Gate


@dataclasses.dataclass(frozen=True)
class GateCase:
    name: str
    q_len: int
    offset: int = 0
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    prior: str | None = "ggd"  # "ggd", "alibi" or None
    betas: tuple[float, ...] = (1.7, 1.0, 0.5, 0.0, -0.6)
    theta_mu: float = 0.0
    documents: bool = False
    ssmax: bool = False
    prior_inside: bool = True
    prior_table: bool = False
    # Learned (theta_alpha, theta_beta) per head instead of the random priors above.
    learned: tuple[tuple[float, float], ...] | None = None
    ssmax_scales: tuple[float, ...] | None = None

    @property
    def kv_len(self) -> int:
        return self.q_len + self.offset


# A quick-start model's priors: a steep head (beta 3.1, bias -7e9 at 8k tokens) that gave
# NaN under SSMax deep in a KV cache in an earlier unmasked loop of the blockwise path.
STEEP_LEARNED_PRIOR = (
    (math.log(14.666), -0.602),
    (math.log(0.131), 2.395),
    (math.log(0.011), -0.128),
    (math.log(0.004), 3.099),
)
STEEP_SSMAX_SCALES = (0.307, 0.26, 0.251, 0.083)


def gate_cases(smoke: bool) -> list[GateCase]:
    """Accelerator sizes span many blocks; smoke sizes still cross several blocks of 16/32."""
    scale = 16 if smoke else 1
    return [
        GateCase("unmasked loop: no documents, GGD, MHA", 1024 // scale, kv_heads=4),
        GateCase(
            "documents and padding, SSMax inside, GQA, T not a block multiple",
            300 // scale + 1,
            documents=True,
            ssmax=True,
            theta_mu=0.4,
        ),
        GateCase(
            "SSMax outside, negative theta_beta, GQA",
            777 // scale,
            heads=8,
            head_dim=128,
            betas=(-0.6, -8.0, 0.3),
            ssmax=True,
            prior_inside=False,
        ),
        GateCase(
            "ALiBi + SSMax, query offset (chunked prefill), head dim not a power of 2",
            200 // scale,
            offset=300 // scale,
            kv_heads=1,
            head_dim=48,
            prior="alibi",
            ssmax=True,
        ),
        GateCase(
            "no prior, MHA, head dim 128", 1000 // scale, kv_heads=4, head_dim=128, prior=None
        ),
        GateCase(
            "prior table: documents, SSMax inside, GQA",
            1024 // scale + 3,
            documents=True,
            ssmax=True,
            theta_mu=0.4,
            prior_table=True,
        ),
        GateCase(
            "steep learned prior + SSMax, 512 queries 7680 into a KV cache",
            512 // scale,
            offset=7680 // scale,
            kv_heads=4,
            head_dim=16,
            learned=STEEP_LEARNED_PRIOR,
            ssmax_scales=STEEP_SSMAX_SCALES,
            ssmax=True,
        ),
    ]


def gate_inputs(case: GateCase, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    t, s, d = case.q_len, case.kv_len, case.head_dim

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    inputs = {
        "q": normal(1, t, case.heads, d),
        "k": normal(1, s, case.kv_heads, d),
        "v": normal(1, s, case.kv_heads, d),
        "prior": make_prior(case.prior, case.heads, case.betas, case.theta_mu),
        "ssmax": None,
        "q_seg": None,
        "k_seg": None,
    }
    if case.learned is not None:
        alpha_H, beta_H = (
            jnp.asarray(column, jnp.float32) for column in zip(*case.learned, strict=True)
        )
        inputs["prior"] = GGDPrior(alpha_H, beta_H, jnp.zeros_like(alpha_H))
    if case.ssmax:
        scales = case.ssmax_scales or rng.uniform(0.5, 1.5, case.heads)
        inputs["ssmax"] = jnp.asarray(scales, jnp.float32)
    if case.documents:
        k_seg = np.sort(rng.integers(0, 3, size=(1, s)), axis=1)
        k_seg[:, -5:] = -1  # trailing padding
        k_seg[0, s // 2] = -1  # a hole inside a document
        inputs["k_seg"] = jnp.asarray(k_seg, jnp.int32)
        inputs["q_seg"] = jnp.asarray(k_seg[:, case.offset :], jnp.int32)
    return inputs


def make_prior(
    kind: str | None,
    heads: int,
    betas: tuple[float, ...] = (-0.5, 1.7),
    theta_mu: float = 0.0,
) -> GGDPrior | AlibiPrior | None:
    if kind == "ggd":
        rng = np.random.default_rng(0)
        if len(betas) == 2:
            beta_H = np.linspace(*betas, heads)
        else:
            beta_H = np.resize(np.asarray(betas), heads)
        mu_H = np.full(heads, theta_mu)
        mu_H[0] = 0.0
        return GGDPrior(
            jnp.asarray(np.log(rng.uniform(0.01, 0.5, heads)), jnp.float32),
            jnp.asarray(beta_H, jnp.float32),
            jnp.asarray(mu_H, jnp.float32),
        )
    if kind == "alibi":
        return AlibiPrior(jnp.asarray(alibi_slopes(heads)))
    return None


def _attention_options(case: GateCase, inputs: dict) -> dict:
    return dict(
        query_segment_ids_BxT=inputs["q_seg"],
        key_segment_ids_BxS=inputs["k_seg"],
        query_offset=case.offset,
    )


def gate_functions(case: GateCase, inputs: dict, settings: Settings) -> tuple[Callable, Callable]:
    """(kernel, reference) as f(q, k, v, prior, ssmax) -> out."""
    options = _attention_options(case, inputs)
    spec = AttentionSpec(ssmax_prior_inside=case.prior_inside)
    tiled = spec.replace(block_q=settings.block_q, block_k=settings.block_k)

    def kernel(q, k, v, prior, ssmax):
        return pallas_attention(
            q,
            k,
            v,
            tiled,
            prior=prior,
            ssmax_scale_H=ssmax,
            backend=settings.backend,
            interpret=settings.interpret,
            prior_table=case.prior_table,
            **options,
        )

    def reference(q, k, v, prior, ssmax):
        with jax.default_matmul_precision("highest"):
            return reference_attention(q, k, v, spec, prior=prior, ssmax_scale_H=ssmax, **options)

    return kernel, reference


def gate_checks(case: GateCase, settings: Settings) -> Iterator[tuple[str, float, float]]:
    """(check name, error, threshold) for values in f32 and bf16 and every gradient."""
    inputs = gate_inputs(case)
    kernel, reference = gate_functions(case, inputs, settings)
    primals = (inputs["q"], inputs["k"], inputs["v"], inputs["prior"], inputs["ssmax"])
    for dtype, check in ((jnp.float32, "values float32"), (jnp.bfloat16, "values bfloat16")):
        qkv = tuple(x.astype(dtype) for x in primals[:3])
        got = jax.jit(kernel)(*qkv, *primals[3:]).astype(jnp.float32)
        want = reference(*(x.astype(jnp.float32) for x in qkv), *primals[3:])
        yield check, _max_abs(got - want), GATE_THRESHOLDS[check]
    yield from _gradient_checks(case, inputs, kernel, reference, primals)


def _gradient_checks(
    case, inputs, kernel, reference, primals
) -> Iterator[tuple[str, float, float]]:
    rng = np.random.default_rng(1)
    cotangent = jnp.asarray(rng.normal(size=inputs["q"].shape), jnp.float32)
    visible = visibility_mask(
        AttentionMask(causal=True, window=None, kv_len=case.kv_len),
        jnp.arange(case.q_len) + case.offset,
        jnp.arange(case.kv_len),
        inputs["q_seg"],
        inputs["k_seg"],
    ).any(-1)
    weights = cotangent * visible[..., None, None]

    def loss(fn, *args):
        return jnp.sum(fn(*args) * weights)

    argnums = (0, 1, 2, 3, 4)
    got = jax.jit(jax.grad(functools.partial(loss, kernel), argnums))(*primals)
    want = jax.grad(functools.partial(loss, reference), argnums)(*primals)
    names = ("dq", "dk", "dv", "d prior", "d ssmax_scale")
    for name, g_tree, w_tree in zip(names, got, want, strict=True):
        leaves = jax.tree_util.tree_leaves_with_path(w_tree)
        for (path, w), g in zip(leaves, jax.tree.leaves(g_tree), strict=True):
            label = name + jax.tree_util.keystr(path)
            scale = max(1.0, _max_abs(w))
            yield f"gradient {label}", _max_abs(g - w) / scale, GATE_THRESHOLDS["gradient"]


def _max_abs(x: jax.Array) -> float:
    return float(jnp.max(jnp.abs(x))) if x.size else 0.0


def run_gate(report: Report, settings: Settings) -> bool:
    """True when every check of every case is within its threshold (NaN fails)."""
    report.table(
        "a. Gate: Pallas kernel vs float32 reference (matmul precision highest)",
        ("case", "T", "S", "heads / kv heads", "D", "check", "error", "threshold", "result"),
    )
    passed = True
    for case in gate_cases(settings.interpret):
        shape = (
            case.name,
            case.q_len,
            case.kv_len,
            f"{case.heads} / {case.kv_heads}",
            case.head_dim,
        )
        try:
            for check, error, threshold in gate_checks(case, settings):
                ok = error <= threshold
                passed &= ok
                report.row(*shape, check, f"{error:.2e}", threshold, "ok" if ok else "FAIL")
        except Exception as error:
            passed = False
            report.row(*shape, "run", one_line(error), "", "FAIL")
    report.add("", f"Gate: {'PASS' if passed else 'FAIL'}")
    return passed


# ---------------------------------------------------------------------------------------
# b. Throughput


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
    return lambda q, k, v, prior: pallas_attention(q, k, v, spec, prior=prior, **options)


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


# ---------------------------------------------------------------------------------------
# c. Training step


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


def measure_training(cfg, settings: Settings, deadline: Deadline) -> dict[str, float]:
    from bam_jax.model import count_params
    from bam_train.data import train_iterator
    from bam_train.setup import build

    setup = build(cfg)
    start = time.perf_counter()
    compiled = setup.train_step.lower(
        setup.abstract_sharded_state(), setup.abstract_batch(), setup.step_values
    ).compile()
    compile_s = time.perf_counter() - start
    state = setup.init()
    batch = setup.global_batch(next(train_iterator(cfg.data, cfg.seq_len, 0, setup.layout())))
    for _ in range(2):  # warm-up
        state, metrics = compiled(state, batch, setup.step_values)
    jax.block_until_ready(metrics)
    times: list[float] = []
    while len(times) < settings.train_steps and deadline.remaining() > 10 * max(times, default=0):
        start = time.perf_counter()
        state, metrics = compiled(state, batch, setup.step_values)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tokens = cfg.batch_size * cfg.seq_len
    params = count_params(setup.abstract_state.params)
    return {
        "params": params,
        "compile_s": compile_s,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "tflops": training_flops(params, cfg, tokens) / step_s / 1e12,
    }


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
            r = measure_training(training_config(implementation, settings), settings, deadline)
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


# ---------------------------------------------------------------------------------------
# Command line


# ---------------------------------------------------------------------------------------
# d. Autotune


def autotune_configs(settings: Settings) -> list[dict[str, int]]:
    """Every AUTOTUNE_GRID combination the GPU kernel accepts (smoke: the small blocks)."""
    names = tuple(AUTOTUNE_GRID)
    configs = [dict(zip(names, values, strict=True)) for values in product(*AUTOTUNE_GRID.values())]
    if settings.interpret:
        configs = [c for c in configs if c["block_q"] == 64 and c["block_k"] == 32][:2]
    return configs


def run_autotune(
    report: Report, settings: Settings, deadline: Deadline, f32_tflops: float, gate_passed: bool
) -> None:
    length, s = settings.lengths[0], settings
    report.table(
        f"d. Autotune: pallas+ggd forward, T {length}, D {s.head_dim}, {s.heads} heads, bf16",
        ("block_q", "block_k", "warps", "stages", "ms", "TFLOP/s", "vs f32 matmul", "note"),
    )
    if not gate_passed:
        report.row("", "", "", "", "", "", "", "skipped: the gate failed")
        return
    keys = jax.random.split(jax.random.key(length), 3)
    shape = (1, length, s.heads, s.head_dim)
    qkv = tuple(jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
    prior = make_prior("ggd", s.heads)
    flops = causal_forward_flops(1, s.heads, length, s.head_dim)
    results = []
    for config in autotune_configs(settings):
        cells = tuple(config.values())
        if deadline.remaining() < s.compile_allowance_s:
            report.row(*cells, "", "", "", "skipped: would pass the deadline")
            continue
        spec = AttentionSpec(block_q=config["block_q"], block_k=config["block_k"])
        fn = jax.jit(
            functools.partial(
                pallas_attention,
                spec=spec,
                backend=s.backend,
                interpret=s.interpret,
                prior=prior,
                num_warps=config["num_warps"],
                num_stages=config["num_stages"],
            )
        )
        try:
            _, median = time_call(fn, qkv, s.iters, s.max_seconds_per_row)
        except Exception as error:
            report.row(*cells, "", "", "", f"failed: {one_line(error)}")
            continue
        tflops = flops / median / 1e12
        results.append((median, config))
        report.row(
            *cells, f"{median * 1e3:.3g}", f"{tflops:.3g}", f"{tflops / f32_tflops:.2f}x", ""
        )
    if results:
        best = min(results, key=lambda item: item[0])[1]
        padded = max(16, 1 << (s.head_dim - 1).bit_length())
        values = ", ".join(str(v) for v in best.values())
        report.add("", f"Fastest: `GPU_DEFAULTS[{padded}] = GpuDefaults({values})`")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes on CPU, kernels in interpret mode: proves the script, measures nothing",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="markdown table, rewritten after every row"
    )
    parser.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S)
    parser.add_argument("--sections", nargs="+", default=list(DEFAULT_SECTIONS), choices=SECTIONS)
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument(
        "--head-dim",
        type=int,
        default=None,
        help=f"throughput and autotune rows (default {DEFAULT_HEAD_DIM})",
    )
    parser.add_argument(
        "--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=ALL_VARIANTS
    )
    parser.add_argument("--iters", type=int, default=3, help="timed calls per throughput row")
    parser.add_argument("--train-batch", type=int, default=16, help="sequences per training step")
    args = parser.parse_args(argv)
    for name in ("deadline_s", "iters", "train_batch"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.head_dim is not None and args.head_dim <= 0:
        parser.error(f"--head-dim must be positive, got {args.head_dim}")
    if args.lengths and min(args.lengths) <= 0:
        parser.error(f"--lengths must be positive, got {args.lengths}")
    return args


def header(settings: Settings, args: argparse.Namespace, today: datetime.date) -> list[str]:
    kind = device_kind()
    mode = "compiled"
    if settings.interpret:
        mode = "smoke run, Pallas in interpret mode: timings mean nothing"
    validated = "yes" if kind in FUSED_VALIDATED_DEVICES else "no"
    return [
        f"# Accelerator check: {kind}, {today.isoformat()}",
        "",
        f"jax {jax.__version__}, platform {settings.platform}, {jax.device_count()} device(s), "
        f"{mode}; deadline {args.deadline_s:.0f} s. "
        f"Listed in FUSED_VALIDATED_DEVICES: {validated}.",
    ]


def run_check(args: argparse.Namespace) -> int:
    """0 when the gate passed (or was not run), 1 when it failed."""
    settings = make_settings(args)
    today = datetime.date.today()
    report = Report(args.out or default_out_path(today))
    deadline = Deadline(args.deadline_s)
    timer = stop_at_deadline(report, deadline)
    report.add(*header(settings, args, today))
    n = 256 if settings.interpret else 8192
    f32_tflops = matmul_tflops(jnp.float32, n)
    bf16_tflops = matmul_tflops(jnp.bfloat16, n)
    report.add(
        "",
        f"Matmul {n}x{n}, precision highest: float32 {f32_tflops:.2f} TFLOP/s, "
        f"bfloat16 {bf16_tflops:.2f} TFLOP/s; 'vs f32 matmul' divides by the float32 rate.",
    )
    gate_passed = run_gate(report, settings) if "gate" in args.sections else True
    if "throughput" in args.sections:
        run = ThroughputRun(report, settings, deadline, f32_tflops, gate_passed)
        run_throughput(run, tuple(args.variants))
    if "training" in args.sections:
        run_training(report, settings, deadline, f32_tflops, gate_passed)
    if "autotune" in args.sections:
        run_autotune(report, settings, deadline, f32_tflops, gate_passed)
    timer.cancel()
    elapsed = args.deadline_s - deadline.remaining()
    report.add("", f"Finished in {elapsed:.0f} s; table: {report.path}")
    return 0 if gate_passed else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run_check(args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
