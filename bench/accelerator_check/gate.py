"""a. The gate: the Pallas kernel against the float32 reference, values and gradients."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from bam_jax.attention import reference_attention
from bam_jax.attention_spec import AttentionSpec
from bam_jax.fused_attention import fused_attention
from bam_jax.masking import AttentionMask, visibility_mask
from bam_jax.priors import AlibiPrior, GGDPrior, alibi_slopes
from bench.accelerator_check.report import Report, one_line
from bench.accelerator_check.settings import Settings

GATE_THRESHOLDS = {
    # max |kernel - reference|; the kernel's own dots may use TF32 or approximate exp2
    "values float32": 2e-3,
    # the bf16 input tolerance of tests/kernels/test_pallas_attention.py
    "values bfloat16": 3e-2,
    # max |kernel - reference| / max(1, max |reference|), per gradient
    "gradient": 1e-2,
}


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
        return fused_attention(
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
