"""SSMax jitter: scale factors per row for the uncapped SSMax layers, and the model's
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
    factors_AxLxB = np.asarray(ssmax_jitter_factors(cfg, jnp.int32(7), 2, 64))
    assert factors_AxLxB.shape == (2, 3, 64)
    np.testing.assert_array_equal(factors_AxLxB[:, 0], 1.0)
    np.testing.assert_array_equal(factors_AxLxB[:, 1], factors_AxLxB[:, 2])
    rows = factors_AxLxB[:, 1].ravel()
    assert rows.min() >= 0.5 and rows.max() <= 1.0
    assert rows.max() - rows.min() > 0.3, "the rows' draws should spread over the range"
    assert not np.array_equal(factors_AxLxB[0, 1], factors_AxLxB[1, 1]), "micro-batches differ"
    again = np.asarray(ssmax_jitter_factors(cfg, jnp.int32(7), 2, 64))
    np.testing.assert_array_equal(again, factors_AxLxB)
    next_step = np.asarray(ssmax_jitter_factors(cfg, jnp.int32(8), 2, 64))
    assert not np.array_equal(next_step, factors_AxLxB)
    other_seed = np.asarray(ssmax_jitter_factors(jitter_config(0.5, seed=1), jnp.int32(7), 2, 64))
    assert not np.array_equal(other_seed, factors_AxLxB)


def test_windowed_layers_are_not_jittered():
    cfg = TrainConfig(model=MODEL.replace(ssmax_capped_layers=0, local_layers=2), ssmax_jitter=0.5)
    factors_AxLxB = np.asarray(ssmax_jitter_factors(cfg, jnp.int32(3), 1, 16))
    np.testing.assert_array_equal(factors_AxLxB[:, :2], 1.0)
    assert factors_AxLxB[:, 2].min() < 0.9


def test_no_jitter_gives_no_factors():
    assert ssmax_jitter_factors(jitter_config(0.0), jnp.int32(3), 1, 4) is None


@pytest.mark.parametrize("scan_layers", [False, True])
def test_factors_scale_each_layers_learned_ssmax_scale(scan_layers):
    config = MODEL.replace(scan_layers=scan_layers)
    model = Transformer(config, rngs=nnx.Rngs(0))
    tokens_BxT = jax.random.randint(jax.random.key(1), (2, 24), 0, config.vocab_size)
    factors_L = jnp.asarray([1.0, 0.6, 0.8], jnp.float32)
    jittered = model.hidden_states(tokens_BxT, ssmax_scale_factors=factors_L)
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


@pytest.mark.parametrize("attention_impl", ["reference", "blockwise"])
@pytest.mark.parametrize("scan_layers", [False, True])
def test_factors_per_row_give_each_row_its_own_scale(scan_layers, attention_impl):
    """Values and gradients of a [n_layers, B] factor equal, row by row, those of the row's
    [n_layers] factor, with documents (segment ids) and a length off the block size."""
    config = MODEL.replace(
        scan_layers=scan_layers, attention_impl=attention_impl, block_q=8, block_k=8
    )
    model = Transformer(config, rngs=nnx.Rngs(0))
    tokens_BxT = jax.random.randint(jax.random.key(1), (2, 21), 0, config.vocab_size)
    segment_ids_BxT = jnp.asarray([[0] * 21, [0] * 9 + [1] * 12], jnp.int32)
    factors_LxB = jnp.asarray([[1.0, 1.0], [0.6, 0.9], [0.8, 0.3]], jnp.float32)

    def loss(m, tokens, segments, factors):
        hidden = m.hidden_states(tokens, segments, ssmax_scale_factors=factors)
        return jnp.sum(jnp.sin(hidden))

    per_row, grads = nnx.value_and_grad(loss)(model, tokens_BxT, segment_ids_BxT, factors_LxB)
    row_values, row_grads = [], []
    for b in range(2):
        rows = slice(b, b + 1)
        value, grad = nnx.value_and_grad(loss)(
            model, tokens_BxT[rows], segment_ids_BxT[rows], factors_LxB[:, b]
        )
        row_values.append(value)
        row_grads.append(grad)
    np.testing.assert_allclose(per_row, sum(row_values), rtol=1e-5)
    summed = jax.tree.map(lambda a, b: a + b, *row_grads)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(summed), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(2,), (3, 2), (3, 1, 1)])
def test_factors_of_the_wrong_shape_are_refused(shape):
    model = Transformer(MODEL, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"shape \[n_layers\] = \(3,\) or \[n_layers, batch\]"):
        model.hidden_states(jnp.zeros((1, 8), jnp.int32), ssmax_scale_factors=jnp.ones(shape))


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
