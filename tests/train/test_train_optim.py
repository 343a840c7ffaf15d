"""Optimizer groups, weight decay, learning rate schedule and clipping."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bam_configs.training import OptimConfig
from bam_jax.config import ModelConfig
from bam_train.optim import ScheduleValues, learning_rate, learning_rates, make_optimizer
from bam_train.state import ModelParts
from tests.support import REPO_ROOT

ROOT = REPO_ROOT


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
    tx = make_optimizer(cfg, parts.labels)
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero_grads, tx.init(params), params, schedule=ScheduleValues.of(cfg, 10))
    # With zero gradients only the decoupled decay moves a parameter: -lr * wd * p.
    np.testing.assert_allclose(updates["layers"][0]["attention"]["wq"]["kernel"], -0.05)
    np.testing.assert_allclose(updates["tok_embeddings"]["embedding"], -0.05)
    for leaf in (updates["norm"]["weight"], updates["prior"]["theta_beta"]):
        np.testing.assert_array_equal(leaf, 0.0)
    np.testing.assert_array_equal(updates["layers"][1]["attention"]["seq_scale"], 0.0)

    grads = jax.tree.map(jnp.ones_like, params)
    no_decay = OptimConfig(lr=0.1, prior_lr=0.01, ssmax_lr=0.001, weight_decay=0.0, clip_norm=0)
    tx = make_optimizer(no_decay, parts.labels)
    schedule = ScheduleValues.of(no_decay, 10)
    updates, _ = tx.update(grads, tx.init(params), params, schedule=schedule)
    # RAdam's first step is momentum SGD: the update is -lr * g with bias correction.
    np.testing.assert_allclose(updates["norm"]["weight"], -0.1, rtol=1e-5)
    np.testing.assert_allclose(updates["prior"]["theta_alpha"], -0.01, rtol=1e-5)
    np.testing.assert_allclose(updates["layers"][0]["attention"]["seq_scale"], -0.001, rtol=1e-5)


def test_schedule_warmup_cosine_and_final_fraction():
    values = ScheduleValues.of(OptimConfig(lr=1.0, warmup_steps=4, final_lr_fraction=0.1), 14)

    def lr(step: int) -> float:
        return float(learning_rate(values, "decay", jnp.int32(step)))

    np.testing.assert_allclose([lr(s) for s in range(4)], [0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(lr(9), 0.55, rtol=1e-6)
    np.testing.assert_allclose(lr(14), 0.1, rtol=1e-6)
    np.testing.assert_allclose(lr(100), 0.1, rtol=1e-6)
    no_warmup = ScheduleValues.of(OptimConfig(lr=1.0), 10)
    assert float(learning_rate(no_warmup, "decay", jnp.int32(0))) == 1.0
    assert learning_rates(ScheduleValues.of(OptimConfig(prior_lr=0.5), 10), 0)["prior_lr"] == 0.5


def optax_warmup_cosine(peak: float, cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """The schedule built from optax's cosine schedule with the numbers as constants."""
    cosine = optax.cosine_decay_schedule(
        peak, max(total_steps - cfg.warmup_steps, 1), alpha=cfg.final_lr_fraction
    )
    if cfg.warmup_steps == 0:
        return cosine
    warmup = cfg.warmup_steps

    def warmup_then_cosine(step: jax.Array) -> jax.Array:
        return jnp.where(step < warmup, peak * (step + 1) / warmup, cosine(step - warmup))

    return warmup_then_cosine


@pytest.mark.parametrize(
    "cfg, total_steps",
    [
        (OptimConfig(lr=3e-3, prior_lr=3e-2, ssmax_lr=1e-2, warmup_steps=20), 5000),
        (OptimConfig(lr=1e-3, final_lr_fraction=0.3), 1500),
        (OptimConfig(lr=7e-4, warmup_steps=3, final_lr_fraction=0.0), 7),
        (
            OptimConfig(
                lr=2.5e-4, prior_lr=0.1, ssmax_lr=7e-3, warmup_steps=13, final_lr_fraction=0.05
            ),
            977,
        ),
    ],
)
def test_schedule_values_round_as_optax_constants_do(cfg, total_steps):
    # The compiled schedule takes its numbers as arrays; it must give the learning rates of
    # the schedule that held them as constants: bit for bit with the jax that
    # constraints.txt pins (whose XLA folds the constants as ScheduleValues does), within a
    # few float32 ulps with others (jax 0.12's XLA folds them in another order).
    steps = jnp.arange(total_steps + 10, dtype=jnp.int32)
    values = ScheduleValues.of(cfg, total_steps)
    for group, peak in (("decay", cfg.lr), ("prior", cfg.prior_lr), ("ssmax", cfg.ssmax_lr)):
        as_values = jax.jit(jax.vmap(lambda v, s, g=group: learning_rate(v, g, s), (None, 0)))
        as_constants = jax.jit(jax.vmap(optax_warmup_cosine(peak, cfg, total_steps)))
        got, want = np.asarray(as_values(values, steps)), np.asarray(as_constants(steps))
        if jax.__version__ == pinned_version("jax"):
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def pinned_version(distribution: str) -> str | None:
    """The version constraints.txt pins `distribution` to (None when it pins none)."""
    text = (ROOT / "constraints.txt").read_text(encoding="utf-8")
    found = re.search(rf"^{re.escape(distribution)}==(\S+)$", text, re.M)
    return found.group(1) if found else None


def test_an_update_without_schedule_values_says_what_it_needs(parts_and_params):
    parts, params = parts_and_params
    tx = make_optimizer(OptimConfig(), parts.labels)
    with pytest.raises(TypeError, match=r"schedule=ScheduleValues.of"):
        tx.update(params, tx.init(params), params)


def test_clipping_by_global_norm(parts_and_params):
    parts, params = parts_and_params
    cfg = OptimConfig(lr=1.0, weight_decay=0.0, clip_norm=1.0)
    tx = make_optimizer(cfg, parts.labels)
    huge = jax.tree.map(lambda p: jnp.full_like(p, 1e6), params)
    updates, _ = tx.update(huge, tx.init(params), params, schedule=ScheduleValues.of(cfg, 10))
    assert float(optax.tree.norm(updates)) == pytest.approx(1.0, rel=1e-3)


def torch_radam_steps(grads_SxN, lr, wd, b1=0.9, b2=0.95, eps=1e-8, max_norm=1.0):
    """torch.optim.RAdam(decoupled_weight_decay=True) after clip_grad_norm_, in float64
    (a transcription of their update rule), from parameters of ones."""
    param = np.ones(grads_SxN.shape[1])
    m, v = np.zeros_like(param), np.zeros_like(param)
    rho_inf = 2 / (1 - b2) - 1
    for t, grad in enumerate(grads_SxN, start=1):
        grad = grad * min(1.0, max_norm / (np.linalg.norm(grad) + 1e-6))
        param = param * (1 - lr * wd)
        m = b1 * m + (1 - b1) * grad
        v = b2 * v + (1 - b2) * grad**2
        m_hat = m / (1 - b1**t)
        rho_t = rho_inf - 2 * t * b2**t / (1 - b2**t)
        if rho_t > 5:
            rect = np.sqrt(
                (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
            )
            param = param - lr * m_hat * rect * np.sqrt(1 - b2**t) / (np.sqrt(v) + eps)
        else:
            param = param - lr * m_hat
    return param


@pytest.mark.parametrize("numerics", ["optax", "torch"])
def test_torch_numerics_step_as_torch_radam_does(numerics):
    # Gradients near eps, where the two placements of eps differ most, and one large
    # gradient that is clipped.
    rng = np.random.default_rng(0)
    grads_SxN = rng.normal(size=(12, 6)) * np.array([1e-8, 3e-8, 1e-7, 1e-3, 1e-1, 1.0])
    grads_SxN[3] *= 100.0
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, final_lr_fraction=1.0, numerics=numerics)
    tx = make_optimizer(cfg, {"w": "decay"})
    schedule = ScheduleValues.of(cfg, 12)
    params = {"w": jnp.ones((1, 6), jnp.float32)}
    state = tx.init(params)
    for grad in grads_SxN:
        grad_1xN = {"w": jnp.asarray(grad[None], jnp.float32)}
        updates, state = tx.update(grad_1xN, state, params, schedule=schedule)
        params = optax.apply_updates(params, updates)
    expected = torch_radam_steps(grads_SxN, lr=1e-2, wd=0.1)
    error = np.abs(np.asarray(params["w"][0], np.float64) - expected).max()
    if numerics == "torch":
        assert error < 1e-6
    else:
        assert error > 1e-4


def test_numerics_must_be_named():
    with pytest.raises(ValueError, match=r"optim.numerics must be one of \('optax', 'torch'\)"):
        OptimConfig(numerics="pytorch")


@pytest.mark.parametrize("numerics", ["optax", "torch"])
def test_optimizer_state_can_be_donated(parts_and_params, numerics):
    parts, params = parts_and_params
    tx = make_optimizer(OptimConfig(numerics=numerics), parts.labels)
    donated = jax.jit(lambda state: state, donate_argnums=0)(tx.init(params))
    assert jax.tree.structure(donated) == jax.tree.structure(tx.init(params))
