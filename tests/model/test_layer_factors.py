"""Training's per-layer factors: SSMax jitter (scale factors per micro-batch for the uncapped
SSMax layers) and prior dilation (distance factors for the global layers' positions: BAM and
ALiBi priors, RoPE and sinusoidal positions), and the model's forward under them."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bam_configs.presets import preset
from bam_configs.training import TrainConfig
from bam_jax.attention import dot_product_attention
from bam_jax.config import ModelConfig
from bam_jax.layer_inputs import LayerFactors
from bam_jax.model import Attention, Transformer
from bam_jax.positional import apply_rope, sinusoidal_embedding
from bam_jax.priors import GGDPrior, alibi_slopes
from bam_train.data import train_iterator
from bam_train.setup import build
from bam_train.step import StepValues, layer_factors

MODEL = ModelConfig.of_size(
    "nano", encoding="bam_ssmax", n_layers=3, ssmax_capped_layers=1, attention_impl="reference"
)


def jitter_config(jitter: float, seed: int = 0) -> TrainConfig:
    return TrainConfig(model=MODEL, ssmax_jitter=jitter, seed=seed)


def factors_of(cfg: TrainConfig, step: jax.Array, micro_batches: int) -> LayerFactors | None:
    return layer_factors(cfg, StepValues.of(cfg), step, micro_batches)


def ssmax_jitter_factors(cfg: TrainConfig, step: jax.Array, micro_batches: int) -> jax.Array:
    factors = factors_of(cfg, step, micro_batches)
    assert factors.prior_dilation_L is None
    return factors.ssmax_scale_L


def test_factors_lie_in_range_leave_capped_layers_alone_and_follow_seed_and_step():
    cfg = jitter_config(0.5)
    factors = np.concatenate(
        [np.asarray(ssmax_jitter_factors(cfg, jnp.int32(s), 2)) for s in range(32)]
    )
    assert factors.shape == (64, 3)
    np.testing.assert_array_equal(factors[:, 0], 1.0)
    np.testing.assert_array_equal(factors[:, 1], factors[:, 2])
    assert factors[:, 1].min() >= 0.5 and factors[:, 1].max() <= 1.0
    assert factors[:, 1].max() - factors[:, 1].min() > 0.3, "draws should spread over the range"
    assert factors[14, 1] != factors[15, 1], "the micro-batches of a step draw their own"
    again = np.asarray(ssmax_jitter_factors(cfg, jnp.int32(7), 2))
    np.testing.assert_array_equal(again, factors[14:16])
    other_seed = np.asarray(ssmax_jitter_factors(jitter_config(0.5, seed=1), jnp.int32(7), 2))
    assert not np.array_equal(other_seed, factors[14:16])


def test_windowed_layers_are_not_jittered():
    cfg = TrainConfig(model=MODEL.replace(ssmax_capped_layers=0, local_layers=2), ssmax_jitter=0.5)
    factors_AxL = np.asarray(ssmax_jitter_factors(cfg, jnp.int32(3), 4))
    np.testing.assert_array_equal(factors_AxL[:, :2], 1.0)
    assert factors_AxL[:, 2].min() < 0.9


def test_no_jitter_and_no_dilation_give_no_factors():
    assert factors_of(jitter_config(0.0), jnp.int32(3), 1) is None


hidden_states = nnx.jit(Transformer.hidden_states)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_factors_scale_each_layers_learned_ssmax_scale(scan_layers):
    config = MODEL.replace(scan_layers=scan_layers)
    model = Transformer(config, rngs=nnx.Rngs(0))
    tokens_BxT = jax.random.randint(jax.random.key(1), (2, 24), 0, config.vocab_size)
    factors_L = jnp.asarray([1.0, 0.6, 0.8], jnp.float32)
    jittered = hidden_states(model, tokens_BxT, layer_factors=LayerFactors(ssmax_scale_L=factors_L))
    scaled = Transformer(config, rngs=nnx.Rngs(0))
    if scan_layers:
        scale_LxH = scaled.layers.attention.seq_scale
        scale_LxH[...] = scale_LxH[...] * factors_L[:, None]
    else:
        for layer, factor in zip(scaled.layers, factors_L, strict=True):
            layer.attention.seq_scale[...] = layer.attention.seq_scale[...] * factor
    np.testing.assert_allclose(jittered, hidden_states(scaled, tokens_BxT), rtol=1e-6, atol=1e-6)
    unjittered = hidden_states(model, tokens_BxT)
    assert np.abs(np.asarray(jittered) - np.asarray(unjittered)).max() > 1e-4


@pytest.mark.parametrize("field", ["ssmax_scale_L", "prior_dilation_L"])
def test_factors_of_the_wrong_shape_are_refused(field):
    model = Transformer(MODEL, rngs=nnx.Rngs(0))
    factors = LayerFactors(**{field: jnp.ones(2)})
    with pytest.raises(ValueError, match=rf"{field} must have shape \[n_layers\] = \(3,\)"):
        model.hidden_states(jnp.zeros((1, 8), jnp.int32), layer_factors=factors)


@pytest.mark.parametrize(
    "encoding, field, message",
    [
        ("bam", "ssmax_scale_L", "needs an SSMax encoding"),
        (
            "nope_ssmax",
            "prior_dilation_L",
            r"the model has no positions to dilate: encoding='nope_ssmax' \(NoPE\)",
        ),
        ("nope", "prior_dilation_L", r"\(NoPE\)"),
    ],
)
def test_factors_for_a_part_the_model_lacks_are_refused(encoding, field, message):
    model = Transformer(MODEL.replace(encoding=encoding, ssmax_capped_layers=0), rngs=nnx.Rngs(0))
    factors = LayerFactors(**{field: jnp.ones(3)})
    with pytest.raises(ValueError, match=message):
        model.hidden_states(jnp.zeros((1, 8), jnp.int32), layer_factors=factors)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"ssmax_jitter": 1.0}, r"ssmax_jitter must be in \[0, 0.99\]"),
        ({"ssmax_jitter": -0.1}, r"ssmax_jitter must be in \[0, 0.99\]"),
        ({"model": MODEL.replace(encoding="bam", ssmax_capped_layers=0)}, "needs an SSMax"),
        ({"model": MODEL.replace(ssmax_capped_layers=3)}, "all 3 are capped"),
        ({"model": MODEL.replace(local_layers=3)}, r"all 3 are capped .* or windowed"),
    ],
)
def test_bad_jitter_settings_name_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(jitter_config(0.5), **changes)


def first_step_loss(cfg: TrainConfig) -> float:
    setup = build(cfg)
    batch = setup.global_batch(next(train_iterator(cfg.data, cfg.seq_len, 0, setup.layout())))
    _, metrics = setup.train_step(setup.init(), batch, setup.step_values)
    return float(metrics["loss"])


@pytest.mark.parametrize(
    "option, model_changes",
    [
        pytest.param({"ssmax_jitter": 0.5}, {"ssmax_capped_layers": 1}, marks=pytest.mark.slow),
        pytest.param(
            {"prior_dilation": 500.0}, {"prior_beta_init": "linear"}, marks=pytest.mark.slow
        ),
        ({"prior_dilation": 500.0}, {"encoding": "alibi"}),
        pytest.param({"prior_dilation": 500.0}, {"encoding": "rope"}, marks=pytest.mark.slow),
        pytest.param({"prior_dilation": 500.0}, {"encoding": "sinusoidal"}, marks=pytest.mark.slow),
    ],
)
def test_a_train_step_with_factors_runs_and_differs_from_one_without(option, model_changes):
    micro = preset("micro")
    base = micro.replace(model=micro.model.replace(**model_changes))
    with_factors = first_step_loss(base.replace(**option))
    assert np.isfinite(with_factors) and with_factors != first_step_loss(base)


def dilation_config(dilation: float, seed: int = 0, **model_changes) -> TrainConfig:
    return TrainConfig(model=MODEL.replace(**model_changes), prior_dilation=dilation, seed=seed)


def test_a_dilated_prior_is_the_prior_at_longer_distances():
    theta_alpha_H = jnp.asarray([-1.8, -0.1, 0.8, -5.1], jnp.float32)
    theta_beta_H = jnp.asarray([0.53, -1.72, 0.0, 1.38], jnp.float32)
    prior = GGDPrior(theta_alpha_H, theta_beta_H, jnp.zeros(4, jnp.float32))
    distances = -jnp.arange(1, 200, dtype=jnp.float32)
    for factor in (1.0, 7.0, 500.0):
        np.testing.assert_allclose(
            prior.dilated(factor).bias(distances), prior.bias(factor * distances), rtol=2e-5
        )


def test_dilations_are_log_uniform_for_the_global_layers_and_follow_seed_and_step():
    cfg = dilation_config(500.0, local_layers=1, ssmax_capped_layers=0)
    dilations = np.concatenate(
        [np.asarray(factors_of(cfg, jnp.int32(s), 4).prior_dilation_L) for s in range(64)]
    )
    assert dilations.shape == (256, 3)
    np.testing.assert_array_equal(dilations[:, 0], 1.0)
    np.testing.assert_array_equal(dilations[:, 1], dilations[:, 2])
    assert dilations[:, 1].min() >= 1.0 and dilations[:, 1].max() <= 500.0 * (1 + 1e-6)
    logs = np.log(dilations[:, 1]) / math.log(500.0)
    assert abs(np.median(logs) - 0.5) < 0.1, "draws should be uniform in log"
    assert logs.min() < 0.05 and logs.max() > 0.95
    again = np.asarray(factors_of(cfg, jnp.int32(9), 4).prior_dilation_L)
    np.testing.assert_array_equal(again, dilations[36:40])
    other = factors_of(dilation_config(500.0, seed=1, local_layers=1), jnp.int32(9), 4)
    assert not np.array_equal(np.asarray(other.prior_dilation_L), dilations[36:40])


def test_dilation_and_jitter_draw_apart():
    both = factors_of(dilation_config(500.0).replace(ssmax_jitter=0.5), jnp.int32(5), 2)
    jitter_only = factors_of(jitter_config(0.5), jnp.int32(5), 2)
    np.testing.assert_array_equal(both.ssmax_scale_L, jitter_only.ssmax_scale_L)
    assert both.prior_dilation_L.shape == (2, 3)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_dilations_stretch_each_layers_prior(scan_layers):
    config = MODEL.replace(scan_layers=scan_layers, global_prior=False, prior_beta_init="linear")
    model = Transformer(config, rngs=nnx.Rngs(0))
    tokens_BxT = jax.random.randint(jax.random.key(1), (2, 40), 0, config.vocab_size)
    dilations_L = jnp.asarray([1.0, 30.0, 4.0], jnp.float32)
    factors = LayerFactors(prior_dilation_L=dilations_L)
    dilated = hidden_states(model, tokens_BxT, layer_factors=factors)
    stretched = Transformer(config, rngs=nnx.Rngs(0))
    if scan_layers:
        prior = stretched.layers.attention.prior
        shift_LxH = prior.theta_beta[...] * jnp.log(dilations_L)[:, None]
        prior.theta_alpha[...] = prior.theta_alpha[...] + shift_LxH
    else:
        for layer, dilation in zip(stretched.layers, dilations_L, strict=True):
            prior = layer.attention.prior
            prior.theta_alpha[...] = prior.theta_alpha[...] + prior.theta_beta[...] * jnp.log(
                dilation
            )
    expected = hidden_states(stretched, tokens_BxT)
    np.testing.assert_allclose(dilated, expected, rtol=2e-5, atol=2e-5)
    assert np.abs(np.asarray(dilated) - np.asarray(hidden_states(model, tokens_BxT))).max() > 1e-4


def test_a_dilation_stretches_a_global_prior_in_each_layer_it_reaches():
    config = MODEL.replace(global_prior=True, prior_beta_init="linear")
    model = Transformer(config, rngs=nnx.Rngs(0))
    tokens_BxT = jax.random.randint(jax.random.key(1), (2, 40), 0, config.vocab_size)
    factors = LayerFactors(prior_dilation_L=jnp.full((3,), 20.0, jnp.float32))
    dilated = model.hidden_states(tokens_BxT, layer_factors=factors)
    stretched = Transformer(config, rngs=nnx.Rngs(0))
    prior = stretched.prior
    prior.theta_alpha[...] = prior.theta_alpha[...] + prior.theta_beta[...] * jnp.log(20.0)
    expected = stretched.hidden_states(tokens_BxT)
    np.testing.assert_allclose(dilated, expected, rtol=2e-5, atol=2e-5)


def attention_under_dilation(config: ModelConfig, dilation: float) -> tuple[jax.Array, ...]:
    """(the layer's output with `prior_dilation`, its q, k, v projections of the same input)."""
    attention = Attention(config, rngs=nnx.Rngs(0))
    x_BxTxE = jax.random.normal(jax.random.key(2), (2, 40, config.dim), jnp.float32)
    out_BxTxE = attention(x_BxTxE, inputs=attention.layer_inputs(prior_dilation=dilation))
    heads = (2, 40, config.n_heads, config.head_dim)
    qkv = (attention.wq(x_BxTxE), attention.wk(x_BxTxE), attention.wv(x_BxTxE))
    return out_BxTxE, attention, *(y.reshape(heads) for y in qkv)


def test_dilated_alibi_is_alibi_at_dilated_distances():
    config = MODEL.replace(encoding="alibi", ssmax_capped_layers=0)
    out_BxTxE, attention, q, k, v = attention_under_dilation(config, 30.0)
    slopes_H = jnp.asarray(alibi_slopes(config.n_heads))
    distant = AlibiAtDistance(slopes_H, 30.0)
    expected = dot_product_attention(q, k, v, prior=distant, implementation="reference")
    np.testing.assert_allclose(
        out_BxTxE, attention.wo(expected.reshape(2, 40, -1)), rtol=1e-5, atol=1e-5
    )


def test_dilated_rope_rotates_at_dilated_positions():
    config = MODEL.replace(encoding="rope_ssmax", ssmax_capped_layers=0)
    out_BxTxE, attention, q, k, v = attention_under_dilation(config, 7.5)
    positions_T = 7.5 * jnp.arange(40, dtype=jnp.float32)
    q, k = (apply_rope(y, positions_T, theta=config.rope_theta) for y in (q, k))
    expected = dot_product_attention(
        q, k, v, ssmax_scale_H=attention.seq_scale[...], implementation="reference"
    )
    np.testing.assert_allclose(
        out_BxTxE, attention.wo(expected.reshape(2, 40, -1)), rtol=1e-5, atol=1e-5
    )
    undilated = Attention(config, rngs=nnx.Rngs(0))(
        jax.random.normal(jax.random.key(2), (2, 40, config.dim), jnp.float32)
    )
    assert np.abs(np.asarray(out_BxTxE) - np.asarray(undilated)).max() > 1e-4


class AlibiAtDistance:
    """ALiBi written from its definition at `factor` times every distance."""

    def __init__(self, slopes_H: jax.Array, factor: float):
        self.slopes_H, self.factor = slopes_H, factor

    @property
    def num_heads(self) -> int:
        return self.slopes_H.shape[0]

    def bias(self, distance: jax.Array) -> jax.Array:
        d = jnp.asarray(distance, jnp.float32)
        return -self.slopes_H.reshape((-1,) + (1,) * d.ndim) * jnp.abs(self.factor * d)[None]


def test_dilated_sinusoidal_positions_reach_the_first_layer():
    config = MODEL.replace(encoding="sinusoidal", ssmax_capped_layers=0)
    model = Transformer(config, rngs=nnx.Rngs(0))
    tokens_BxT = jax.random.randint(jax.random.key(1), (2, 24), 0, config.vocab_size)
    factors = LayerFactors(prior_dilation_L=jnp.full((3,), 4.0, jnp.float32))
    dilated = model.hidden_states(tokens_BxT, layer_factors=factors)
    embedded = model.tok_embeddings(tokens_BxT) + sinusoidal_embedding(
        4.0 * jnp.arange(24, dtype=jnp.float32), config.dim, theta=config.sinusoidal_theta
    )
    h_BxTxE = embedded
    for block in model.layers:
        h_BxTxE, _ = block(h_BxTxE)
    np.testing.assert_allclose(dilated, model.norm(h_BxTxE), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cannot dilate the global layers apart"):
        Transformer(config.replace(local_layers=1), rngs=nnx.Rngs(0)).hidden_states(
            tokens_BxT, layer_factors=factors
        )


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"prior_dilation": 0.5}, r"prior_dilation must be in \[1, 1e\+06\]"),
        ({"prior_dilation": float("inf")}, "prior_dilation"),
        (
            {"model": MODEL.replace(encoding="nope_ssmax")},
            r"the model has no positions to dilate: encoding='nope_ssmax' \(NoPE\); "
            "set prior_dilation=1",
        ),
        (
            {"model": MODEL.replace(encoding="nope", ssmax_capped_layers=0)},
            "no positions to dilate",
        ),
        (
            {"model": MODEL.replace(encoding="sinusoidal_ssmax", local_layers=1)},
            r"adds its positions once, before every layer, local ones included",
        ),
        (
            {"model": MODEL.replace(encoding="rope_local", ssmax_capped_layers=0)},
            "has no global layer to dilate: all 3 are win",
        ),
        ({"model": MODEL.replace(local_layers=3)}, r"all 3 are windowed \(local_layers"),
    ],
)
def test_bad_dilation_settings_name_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(dilation_config(500.0), **changes)


@pytest.mark.slow
def test_blockwise_attention_under_dilation_matches_the_reference_values_and_gradients():
    """The quick start trains blockwise; its dilated priors must give the reference's values
    and gradients (prior parameters included) at a length that is not a multiple of the
    blocks, with a local layer and negative prior shapes."""
    config = MODEL.replace(
        global_prior=False, prior_beta_init="linear", local_layers=1, local_window=5
    )
    tokens_BxT = jax.random.randint(jax.random.key(1), (2, 45), 0, config.vocab_size)
    dilations_L = jnp.asarray([1.0, 30.0, 4.0], jnp.float32)

    def loss_and_grads(model: Transformer, factors: LayerFactors | None):
        def loss(model):
            hidden = model.hidden_states(tokens_BxT, layer_factors=factors)
            return jnp.sum(hidden * jnp.cos(jnp.arange(hidden.size).reshape(hidden.shape)))

        return nnx.value_and_grad(loss)(model)

    blockwise = Transformer(
        config.replace(attention_impl="blockwise", block_q=16, block_k=16), rngs=nnx.Rngs(0)
    )
    for layer in blockwise.layers:
        layer.attention.prior.theta_beta[...] = jnp.asarray([-0.7, 0.0, 0.5, 1.2], jnp.float32)
    value, grads = loss_and_grads(blockwise, LayerFactors(prior_dilation_L=dilations_L))
    reference = Transformer(config, rngs=nnx.Rngs(0))
    nnx.update(reference, nnx.state(blockwise))
    for layer, dilation in zip(reference.layers, dilations_L, strict=True):
        prior = layer.attention.prior
        prior.theta_alpha[...] = prior.theta_alpha[...] + prior.theta_beta[...] * jnp.log(dilation)
    expected_value, expected_grads = loss_and_grads(reference, None)
    got_grads = nnx.to_pure_dict(grads)
    want_grads = nnx.to_pure_dict(expected_grads)
    # theta_beta also reaches the dilated side's logits through beta * log(u).
    for i, dilation in enumerate(dilations_L):
        prior = want_grads["layers"][i]["attention"]["prior"]
        prior["theta_beta"] = prior["theta_beta"] + jnp.log(dilation) * prior["theta_alpha"]
    np.testing.assert_allclose(value, expected_value, rtol=1e-4)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-4)
