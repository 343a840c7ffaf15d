"""Optimizer groups, weight decay, learning rate schedule and clipping."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bam_jax.config import ModelConfig
from bam_train.config import OptimConfig
from bam_train.optim import learning_rates, make_optimizer, schedule
from bam_train.state import ModelParts


@pytest.fixture(scope="module")
def parts_and_params():
    parts, abstract, _ = ModelParts.from_config(ModelConfig.of_size("nano", encoding="bam_ssmax"))
    params = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), abstract)
    return parts, params


def test_groups_follow_variable_types(parts_and_params):
    parts, _ = parts_and_params
    labels = parts.labels
    assert labels["prior"] == {"theta_alpha": "prior", "theta_beta": "prior"}
    assert labels["layers"][0]["attention"]["seq_scale"] == "ssmax"
    assert labels["layers"][0]["attention"]["wq"]["kernel"] == "decay"
    assert labels["tok_embeddings"]["embedding"] == "decay"
    assert labels["norm"]["weight"] == "no_decay"


def test_weight_decay_only_on_matrices_and_own_learning_rates(parts_and_params):
    parts, params = parts_and_params
    cfg = OptimConfig(lr=0.1, prior_lr=0.01, ssmax_lr=0.001, weight_decay=0.5, clip_norm=0.0)
    tx = make_optimizer(cfg, total_steps=10, labels=parts.labels)
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero_grads, tx.init(params), params)
    # With zero gradients only the decoupled decay moves a parameter: -lr * wd * p.
    np.testing.assert_allclose(updates["layers"][0]["attention"]["wq"]["kernel"], -0.05)
    np.testing.assert_allclose(updates["tok_embeddings"]["embedding"], -0.05)
    for leaf in (updates["norm"]["weight"], updates["prior"]["theta_beta"]):
        np.testing.assert_array_equal(leaf, 0.0)
    np.testing.assert_array_equal(updates["layers"][1]["attention"]["seq_scale"], 0.0)

    grads = jax.tree.map(jnp.ones_like, params)
    no_decay = OptimConfig(lr=0.1, prior_lr=0.01, ssmax_lr=0.001, weight_decay=0.0, clip_norm=0)
    tx = make_optimizer(no_decay, total_steps=10, labels=parts.labels)
    updates, _ = tx.update(grads, tx.init(params), params)
    # RAdam's first step is momentum SGD: the update is -lr * g with bias correction.
    np.testing.assert_allclose(updates["norm"]["weight"], -0.1, rtol=1e-5)
    np.testing.assert_allclose(updates["prior"]["theta_alpha"], -0.01, rtol=1e-5)
    np.testing.assert_allclose(updates["layers"][0]["attention"]["seq_scale"], -0.001, rtol=1e-5)


def test_schedule_warmup_cosine_and_final_fraction():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, final_lr_fraction=0.1)
    lr = schedule(1.0, cfg, total_steps=14)
    np.testing.assert_allclose([lr(s) for s in range(4)], [0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(lr(9), 0.55, rtol=1e-6)
    np.testing.assert_allclose(lr(14), 0.1, rtol=1e-6)
    np.testing.assert_allclose(lr(100), 0.1, rtol=1e-6)
    no_warmup = schedule(1.0, OptimConfig(), total_steps=10)
    assert float(no_warmup(0)) == 1.0
    assert learning_rates(OptimConfig(prior_lr=0.5), 10, 0)["prior_lr"] == 0.5


def test_clipping_by_global_norm(parts_and_params):
    parts, params = parts_and_params
    cfg = OptimConfig(lr=1.0, weight_decay=0.0, clip_norm=1.0)
    tx = make_optimizer(cfg, total_steps=10, labels=parts.labels)
    huge = jax.tree.map(lambda p: jnp.full_like(p, 1e6), params)
    updates, _ = tx.update(huge, tx.init(params), params)
    assert float(optax.tree.norm(updates)) == pytest.approx(1.0, rel=1e-3)
