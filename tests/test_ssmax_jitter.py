"""SSMax jitter: scale factors per micro-batch for the uncapped SSMax layers, and the model's
forward under them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bam_configs.presets import preset
from bam_jax.config import ModelConfig
from bam_jax.model import Transformer
from bam_train.config import TrainConfig
from bam_train.data import train_iterator
from bam_train.loop import build, ssmax_jitter_factors

MODEL = ModelConfig.of_size(
    "nano", encoding="bam_ssmax", n_layers=3, ssmax_capped_layers=1, attention_impl="reference"
)


def jitter_config(jitter: float, seed: int = 0) -> TrainConfig:
    return TrainConfig(model=MODEL, ssmax_jitter=jitter, seed=seed)


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


def test_no_jitter_gives_no_factors():
    assert ssmax_jitter_factors(jitter_config(0.0), jnp.int32(3), 1) is None


@pytest.mark.parametrize("scan_layers", [False, True])
def test_factors_scale_each_layers_learned_ssmax_scale(scan_layers):
    config = MODEL.replace(scan_layers=scan_layers)
    model = Transformer(config, rngs=nnx.Rngs(0))
    tokens_BxT = jax.random.randint(jax.random.key(1), (2, 24), 0, config.vocab_size)
    factors_L = jnp.asarray([1.0, 0.6, 0.8], jnp.float32)
    jittered = model.hidden_states(tokens_BxT, ssmax_scale_factors_L=factors_L)
    scaled = Transformer(config, rngs=nnx.Rngs(0))
    if scan_layers:
        scale_LxH = scaled.layers.attention.seq_scale
        scale_LxH[...] = scale_LxH[...] * factors_L[:, None]
    else:
        for layer, factor in zip(scaled.layers, factors_L, strict=True):
            layer.attention.seq_scale[...] = layer.attention.seq_scale[...] * factor
    np.testing.assert_allclose(jittered, scaled.hidden_states(tokens_BxT), rtol=1e-6, atol=1e-6)
    unjittered = model.hidden_states(tokens_BxT)
    assert np.abs(np.asarray(jittered) - np.asarray(unjittered)).max() > 1e-4


def test_factors_of_the_wrong_shape_are_refused():
    model = Transformer(MODEL, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"shape \[n_layers\] = \(3,\)"):
        model.hidden_states(jnp.zeros((1, 8), jnp.int32), ssmax_scale_factors_L=jnp.ones(2))


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


def test_a_jittered_train_step_runs_and_differs_from_an_unjittered_one():
    base = preset("micro").replace(model=preset("micro").model.replace(ssmax_capped_layers=1))
    losses = {}
    for jitter in (0.0, 0.5):
        setup = build(base.replace(ssmax_jitter=jitter))
        state = setup.init()
        batch = setup.global_batch(next(train_iterator(base.data, base.seq_len, 0, setup.layout())))
        _, metrics = setup.train_step(state, batch)
        losses[jitter] = float(metrics["loss"])
    assert np.isfinite(losses[0.5]) and losses[0.5] != losses[0.0]
