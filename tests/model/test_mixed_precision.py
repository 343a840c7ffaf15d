"""The bfloat16 mixed-precision policy: what is cast, and how far the logits move.

Under dtype="bfloat16" parameters, embeddings and the residual stream stay float32; the
matmuls of the projections, the feed-forward and the output layer multiply in bfloat16;
attention logits, softmax, priors, norms and logits are float32.

Tolerance (measured on random tiny models at 1k and 16k tokens, rounded up to about
twice the largest value seen): on the same weights, max |logit_bf16 - logit_f32| is at
most MAX_ERROR_OVER_STD times the standard deviation of the float32 logits, and the KL
divergence between the two next-token distributions is at most MAX_KL nats at every
position.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bam_eval import api as eval_api
from bam_eval import cli as eval_cli
from bam_jax import model as model_module
from bam_jax.config import ModelConfig
from bam_jax.model import Transformer
from bam_jax.model_state import reconfigure
from bam_jax.reference_checkpoint import export_reference_checkpoint, load_reference_checkpoint
from tests.support.grids import slow_unless
from tests.support.reference_runs import CASES, make_run, write_run

MAX_ERROR_OVER_STD = 0.03
MAX_KL = 2e-5


def tiny(length: int, encoding: str = "bam_ssmax", **overrides) -> ModelConfig:
    """dim 64, 2 layers, blockwise attention: cheap enough for 16k tokens on a CPU."""
    return ModelConfig.of_size(
        "toy",
        vocab_size=256,
        max_seq_len=length,
        encoding=encoding,
        attention_impl="blockwise",
        block_q=512,
        block_k=512,
        prior_alpha_init="slope",
        prior_beta_init="linear",
        **overrides,
    )


def micro(**overrides) -> ModelConfig:
    return ModelConfig.of_size("nano", attention_impl="reference", **overrides)


def tokens(length: int, vocab: int, seed: int = 1) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (1, length), 0, vocab)


def logits(model: Transformer, tokens_BxT: jax.Array) -> np.ndarray:
    return np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens_BxT))


def assert_within_tolerance(half: np.ndarray, full: np.ndarray) -> None:
    assert half.dtype == np.float32 and np.isfinite(half).all()
    error = np.abs(half - full).max() / full.std()
    assert error <= MAX_ERROR_OVER_STD, f"max |bf16 - f32| / std = {error:.4f}"
    log_p, log_q = jax.nn.log_softmax(full), jax.nn.log_softmax(half)
    kl = float((jnp.exp(log_p) * (log_p - log_q)).sum(-1).max())
    assert kl <= MAX_KL, f"max KL(f32 || bf16) = {kl:.2e} nats"


def dot_generals(jaxpr) -> Iterator:
    """Every dot_general equation of a jaxpr, inside nested jaxprs (jit, remat, scan) too."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from dot_generals(inner)


def abstract_forward(model: Transformer, tokens_BxT: jax.Array):
    """Traces the forward pass without running it: its jaxpr and output shapes."""
    graph, state = nnx.split(model)
    return jax.make_jaxpr(lambda s, t: nnx.merge(graph, s)(t))(state, tokens_BxT)


def kernel_matmuls(model: Transformer, tokens_BxT: jax.Array) -> list[tuple[str, str, str]]:
    """(lhs, rhs, result) dtypes of the matmuls against a 2-D weight (not attention's)."""
    jaxpr = abstract_forward(model, tokens_BxT).jaxpr
    return [
        tuple(str(v.aval.dtype) for v in (*eqn.invars, *eqn.outvars))
        for eqn in dot_generals(jaxpr)
        if eqn.invars[1].aval.ndim == 2
    ]


@pytest.mark.parametrize("scan_layers", [False, True])
def test_residual_stream_stays_float32_under_bfloat16(monkeypatch, scan_layers):
    seen: list[tuple[str, str]] = []
    apply_block = model_module._apply_block

    def recording(block, x_BxTxE, *args):
        h_BxTxE, kv = apply_block(block, x_BxTxE, *args)
        seen.append((str(x_BxTxE.dtype), str(h_BxTxE.dtype)))
        return h_BxTxE, kv

    monkeypatch.setattr(model_module, "_apply_block", recording)
    model = Transformer(micro(dtype="bfloat16", scan_layers=scan_layers), rngs=nnx.Rngs(0))
    abstract_forward(model, jnp.zeros((1, 8), jnp.int32))
    assert seen and set(seen) == {("float32", "float32")}, seen


def test_matmuls_multiply_in_bfloat16_and_residual_writes_accumulate_in_float32():
    config = micro(dtype="bfloat16")
    model = Transformer(config, rngs=nnx.Rngs(0))
    matmuls = kernel_matmuls(model, jnp.zeros((1, 8), jnp.int32))
    layers = config.n_layers
    # wq, wk, wv, w1, w3 return bfloat16; wo, w2 and the output layer return float32.
    assert matmuls.count(("bfloat16", "bfloat16", "bfloat16")) == 5 * layers
    assert matmuls.count(("bfloat16", "bfloat16", "float32")) == 2 * layers + 1
    assert len(matmuls) == 7 * layers + 1


def test_float32_model_has_no_bfloat16_anywhere():
    model = Transformer(micro(), rngs=nnx.Rngs(0))
    assert "bf16" not in str(abstract_forward(model, jnp.zeros((1, 8), jnp.int32)))


def test_parameters_are_stored_in_float32_under_bfloat16():
    model = Transformer(micro(dtype="bfloat16"), rngs=nnx.Rngs(0))
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model))} == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize(
    "encoding", slow_unless(["bam_ssmax", "rope", "alibi_ssmax"], default=["bam_ssmax"])
)
def test_bfloat16_logits_within_tolerance_at_1k_tokens(encoding):
    model = Transformer(tiny(1024, encoding), rngs=nnx.Rngs(0))
    tokens_BxT = tokens(1024, model.config.vocab_size)
    half = logits(reconfigure(model, dtype="bfloat16"), tokens_BxT)
    assert_within_tolerance(half, logits(model, tokens_BxT))


@pytest.mark.slow
def test_bfloat16_logits_within_tolerance_at_16k_tokens():
    model = Transformer(tiny(16384), rngs=nnx.Rngs(0))
    tokens_BxT = tokens(16384, model.config.vocab_size)
    half = logits(reconfigure(model, dtype="bfloat16"), tokens_BxT)
    assert_within_tolerance(half, logits(model, tokens_BxT))


def test_bfloat16_loss_and_gradients_are_float32_and_close():
    model = Transformer(micro(), rngs=nnx.Rngs(0))
    tokens_BxT = tokens(32, model.config.vocab_size)

    def loss(m: Transformer) -> jax.Array:
        log_probs = jax.nn.log_softmax(m(tokens_BxT[:, :-1]))
        return -jnp.take_along_axis(log_probs, tokens_BxT[:, 1:, None], -1).mean()

    loss_and_grads = nnx.jit(nnx.value_and_grad(loss))
    full_loss, full_grads = loss_and_grads(model)
    half_loss, half_grads = loss_and_grads(reconfigure(model, dtype="bfloat16"))
    assert half_loss.dtype == jnp.float32
    np.testing.assert_allclose(half_loss, full_loss, rtol=1e-3)
    for half, full in zip(jax.tree.leaves(half_grads), jax.tree.leaves(full_grads), strict=True):
        assert half.dtype == jnp.float32 and np.isfinite(half).all()
        assert np.abs(half - full).max() <= 0.05 * np.abs(full).max() + 1e-6


REFERENCE_CASES = [
    c for c in CASES if c.id in ("bam_ssmax-global-theta", "bam-layer-legacy", "rotary_ssmax")
]


@pytest.mark.parametrize(
    "case", slow_unless(REFERENCE_CASES, REFERENCE_CASES[-1:]), ids=lambda c: c.id
)
def test_reference_checkpoint_under_bfloat16_matches_float32(case, tmp_path: Path):
    run_args, state = make_run(case)
    run_dir = write_run(tmp_path / case.id, run_args, state)
    _, full_model = load_reference_checkpoint(run_dir, attention_impl="blockwise")
    config, half_model = load_reference_checkpoint(
        run_dir, dtype="bfloat16", attention_impl="blockwise"
    )
    assert config.dtype == "bfloat16"
    tokens_BxT = tokens(1024, config.vocab_size)
    assert_within_tolerance(logits(half_model, tokens_BxT), logits(full_model, tokens_BxT))


def bfloat16_trained_run(tmp_path: Path, monkeypatch) -> str:
    """A run whose checkpoint records dtype bfloat16, as training under bfloat16 leaves."""
    config = ModelConfig.of_size("nano", vocab_size=259, max_seq_len=64)
    export_reference_checkpoint(
        Transformer(config, rngs=nnx.Rngs(0)), config, tmp_path / "run", fmt="npz"
    )
    load = eval_api.load_eval_model

    def load_as_trained_in_bfloat16(arg: str, **kwargs) -> eval_cli.EvalModel:
        m = load(arg, **kwargs)
        model = reconfigure(m.model, dtype="bfloat16")
        return dataclasses.replace(m, config=model.config, model=model)

    monkeypatch.setattr(eval_api, "load_eval_model", load_as_trained_in_bfloat16)
    return str(tmp_path / "run")


@pytest.mark.parametrize(
    ("flag", "expected"), [([], "float32"), (["--dtype", "bfloat16"], "bfloat16")]
)
def test_evaluation_runs_in_float32_unless_asked(tmp_path, monkeypatch, capsys, flag, expected):
    run_dir = bfloat16_trained_run(tmp_path, monkeypatch)
    scored_in: list[str] = []
    chunked_forward = eval_api.ChunkedForward

    def recording(model: Transformer, **kwargs):
        scored_in.append(model.config.dtype)
        return chunked_forward(model, **kwargs)

    monkeypatch.setattr(eval_api, "ChunkedForward", recording)
    argv = f"passkey {run_dir} --tokenizer byte --lengths 0 --samples 1 --no-plots --quiet"
    assert eval_cli.main([*argv.split(), "--out", str(tmp_path / "out"), *flag]) == 0
    assert scored_in == [expected]
    printed = capsys.readouterr().out.splitlines()
    assert f"compute dtype: {expected} (parameters float32)" in printed


def test_results_of_each_dtype_are_kept_apart(tmp_path, monkeypatch):
    run_dir = bfloat16_trained_run(tmp_path, monkeypatch)
    out = tmp_path / "out"
    argv = f"passkey {run_dir} --tokenizer byte --lengths 0 --samples 1 --no-plots --quiet"
    for flag in ([], ["--dtype", "bfloat16"]):
        assert eval_cli.main([*argv.split(), "--out", str(out), *flag]) == 0
    with open(out / "run" / "passkey.json", encoding="utf-8") as f:
        runs = json.load(f)["runs"]
    assert sorted(run["settings"]["dtype"] for run in runs.values()) == ["bfloat16", "float32"]
