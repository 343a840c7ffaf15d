"""Priors: ALiBi slopes, the generalized Gaussian prior and its initialisations."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bam_jax.config import ModelConfig
from bam_jax.priors import (
    GGD_EPS,
    GGD_MAX_LOG2_MAGNITUDE,
    PRIOR_PRESETS,
    AlibiPrior,
    GGDPrior,
    alibi_slopes,
    ggd_bias,
    init_ggd_prior,
)


def spec_slopes(num_heads: int) -> list[float]:
    """Spec section 3, written out: 2 ** (-8 (k+1) / H), with the every-other extension."""

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (k + 1) / n) for k in range(n)]

    lower = 1 << (num_heads.bit_length() - 1)
    if lower == num_heads:
        return power_of_two(num_heads)
    return power_of_two(lower) + power_of_two(2 * lower)[0::2][: num_heads - lower]


@pytest.mark.parametrize("num_heads", [*range(1, 13), 16, 24, 64])
def test_alibi_slopes_follow_the_spec(num_heads: int) -> None:
    slopes = alibi_slopes(num_heads)
    assert slopes.dtype == np.float32
    assert slopes.shape == (num_heads,)
    np.testing.assert_allclose(slopes, spec_slopes(num_heads), rtol=1e-6)


def test_alibi_slopes_known_values() -> None:
    np.testing.assert_allclose(alibi_slopes(8), [2.0**-k for k in range(1, 9)], rtol=1e-7)
    np.testing.assert_allclose(alibi_slopes(1), [2.0**-8], rtol=1e-7)
    # 12 heads: the 8-head list, then slopes 1, 3, 5, 7 (0-based 0, 2, 4, 6) of the 16-head list.
    expected = [2.0**-k for k in range(1, 9)] + [2.0 ** (-0.5 * k) for k in (1, 3, 5, 7)]
    np.testing.assert_allclose(alibi_slopes(12), expected, rtol=1e-6)


def test_alibi_slopes_reject_zero_heads() -> None:
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(0)


DISTANCES = jnp.asarray([-1000.0, -37.0, -2.0, -1.0, 0.0, 1.0, 5.0])


def test_ggd_formula_against_numpy() -> None:
    alpha, beta, theta_mu = np.array([0.3, -1.2]), np.array([1.7, -0.6]), np.array([0.2, -0.4])
    bias = ggd_bias(jnp.asarray(alpha), jnp.asarray(beta), jnp.asarray(theta_mu), DISTANCES)
    mu = np.exp(theta_mu) - np.exp(-theta_mu)
    d = np.asarray(DISTANCES, np.float64)
    expected = -np.exp(alpha)[:, None] * (np.abs(d[None] - mu[:, None]) + 1e-5) ** beta[:, None]
    assert bias.dtype == jnp.float32
    assert bias.shape == (2, DISTANCES.shape[0])
    np.testing.assert_allclose(np.asarray(bias), expected, rtol=2e-6)


def test_ggd_special_values() -> None:
    zeros = jnp.zeros((3,), jnp.float32)
    uniform = ggd_bias(zeros, zeros, zeros, DISTANCES)
    np.testing.assert_array_equal(np.asarray(uniform), -1.0)

    log_slopes = jnp.log(jnp.asarray(alibi_slopes(3)))
    linear = ggd_bias(log_slopes, jnp.ones((3,)), zeros, DISTANCES)
    alibi = AlibiPrior(jnp.asarray(alibi_slopes(3))).bias(DISTANCES)
    slopes = np.asarray(alibi_slopes(3))[:, None]
    np.testing.assert_allclose(np.asarray(linear), np.asarray(alibi) - slopes * GGD_EPS, rtol=1e-6)

    quadratic = ggd_bias(zeros, jnp.full((3,), 2.0), zeros, jnp.asarray([3.0]))
    np.testing.assert_allclose(np.asarray(quadratic), -((3.0 + GGD_EPS) ** 2), rtol=1e-7)

    theta_mu = jnp.full((3,), math.asinh(1.5))  # mu = 2 sinh(theta_mu) = 3: the peak
    peaked = ggd_bias(zeros, jnp.full((3,), 0.5), theta_mu, jnp.arange(-10.0, 11.0))
    np.testing.assert_array_equal(np.argmax(np.asarray(peaked), axis=1), 13)
    np.testing.assert_allclose(np.asarray(peaked[:, 13]), -math.sqrt(GGD_EPS), rtol=3e-2)


def test_alibi_prior_bias() -> None:
    prior = AlibiPrior(jnp.asarray([0.5, 0.125]))
    bias = prior.bias(jnp.arange(-3, 2))
    np.testing.assert_allclose(
        np.asarray(bias), [[-1.5, -1, -0.5, 0, -0.5], [-0.375, -0.25, -0.125, 0, -0.125]]
    )
    assert prior.num_heads == 2


@pytest.mark.parametrize("beta", [-0.6, -3.0, 0.0, 0.5])
def test_eps_keeps_negative_beta_finite_in_float32(beta: float) -> None:
    params = (jnp.zeros((1,)), jnp.full((1,), beta), jnp.zeros((1,)))
    bias = ggd_bias(*params, DISTANCES)
    assert np.all(np.isfinite(np.asarray(bias)))
    np.testing.assert_allclose(float(bias[0, 4]), -(GGD_EPS**beta), rtol=1e-5)

    def total(alpha, b, mu):
        return jnp.sum(ggd_bias(alpha, b, mu, DISTANCES))

    for grad in jax.grad(total, argnums=(0, 1, 2))(*params):
        assert np.all(np.isfinite(np.asarray(grad)))


@pytest.mark.parametrize("beta", [-8.0, -30.0])
def test_bias_saturates_instead_of_overflowing(beta: float) -> None:
    """eps ** beta overflows float32 once beta < -7.7; the bias saturates there instead,
    keeps its exact value everywhere else, and no inf reaches the gradients."""
    alpha = 0.3
    params = (jnp.full((1,), alpha), jnp.full((1,), beta), jnp.zeros((1,)))
    bias = np.asarray(ggd_bias(*params, DISTANCES))[0]
    expected = -math.exp(alpha) * (np.abs(np.asarray(DISTANCES, np.float64)) + GGD_EPS) ** beta
    saturated = np.abs(expected) >= 2.0**GGD_MAX_LOG2_MAGNITUDE
    assert saturated.any() and not saturated.all()
    np.testing.assert_array_equal(bias[saturated], -(2.0**GGD_MAX_LOG2_MAGNITUDE))
    np.testing.assert_allclose(bias[~saturated], expected[~saturated], rtol=1e-6, atol=1e-30)

    grads = jax.grad(lambda *p: jnp.sum(ggd_bias(*p, DISTANCES)), argnums=(0, 1))(*params)
    for grad in grads:
        assert np.all(np.isfinite(np.asarray(grad)))
    per_distance = jax.jacobian(lambda b: ggd_bias(params[0], b, params[2], DISTANCES))(params[1])
    np.testing.assert_array_equal(np.asarray(per_distance)[0, saturated, 0], 0.0)


def test_theta_mu_gradient_is_zero_at_the_kink_and_analytic_elsewhere() -> None:
    alpha, beta = jnp.asarray([0.2]), jnp.asarray([-0.6])

    def bias_at(theta_mu, d):
        return ggd_bias(alpha, beta, theta_mu, jnp.asarray([d]))[0, 0]

    assert float(jax.grad(bias_at)(jnp.zeros((1,)), 0.0)[0]) == 0.0
    # d bias / d theta_mu = -e^a * beta * (|d - mu| + eps)^(beta - 1) * sign(d - mu) * (-2 cosh)
    theta_mu = jnp.asarray([0.1])
    mu = 2 * math.sinh(0.1)
    d = -4.0
    expected = (
        -math.exp(0.2) * -0.6 * (abs(d - mu) + GGD_EPS) ** -1.6 * -1.0 * -(2 * math.cosh(0.1))
    )
    np.testing.assert_allclose(float(jax.grad(bias_at)(theta_mu, d)[0]), expected, rtol=1e-5)


# Heads: theta_mu 0 (the kink on d = 0), a negative shape, a large scale with shape above 1.
INFERENCE_PARAMS = {
    "theta_alpha": np.array([0.3, -1.2, 2.0]),
    "theta_beta": np.array([-0.6, -2.5, 1.7]),
    "theta_mu": np.array([0.0, 0.4, -0.3]),
}


def inference_bias_and_grads(d: np.ndarray) -> tuple[np.ndarray, ...]:
    """float64 -(|d - mu| e^a + eps)^b and its derivatives in theta_alpha, theta_beta,
    theta_mu, each [H, X] (the derivative of |z| taken as 0 at z = 0)."""
    a, b, t = (INFERENCE_PARAMS[k][:, None] for k in ("theta_alpha", "theta_beta", "theta_mu"))
    z = d[None] - (np.exp(t) - np.exp(-t))
    gap = np.abs(z) * np.exp(a) + GGD_EPS
    bias = -(gap**b)
    d_alpha = -b * gap ** (b - 1) * np.abs(z) * np.exp(a)
    d_beta = bias * np.log(gap)
    d_theta_mu = b * gap ** (b - 1) * np.exp(a) * np.sign(z) * (np.exp(t) + np.exp(-t))
    return bias, d_alpha, d_beta, d_theta_mu


def test_inference_form_values_and_gradients_against_float64() -> None:
    params = [jnp.asarray(v, jnp.float32) for v in INFERENCE_PARAMS.values()]
    bias = GGDPrior(*params, form="inference").bias(DISTANCES)
    expected, *expected_grads = inference_bias_and_grads(np.asarray(DISTANCES, np.float64))
    assert bias.dtype == jnp.float32 and bias.shape == (3, DISTANCES.shape[0])
    np.testing.assert_allclose(np.asarray(bias), expected, rtol=2e-6)

    def bias_of(alpha, beta, theta_mu):
        return GGDPrior(alpha, beta, theta_mu, form="inference").bias(DISTANCES)

    jacobians = jax.jacobian(bias_of, argnums=(0, 1, 2))(*params)
    for jacobian_HxXxH, want_HxX in zip(jacobians, expected_grads, strict=True):
        got_HxX = np.einsum("hxh->hx", np.asarray(jacobian_HxXxH))
        np.testing.assert_allclose(got_HxX, want_HxX, rtol=2e-5, atol=1e-12)


def test_inference_form_differs_from_the_training_form() -> None:
    params = [jnp.asarray(v, jnp.float32) for v in INFERENCE_PARAMS.values()]
    training = GGDPrior(*params).bias(DISTANCES)
    inference = GGDPrior(*params, form="inference").bias(DISTANCES)
    assert not np.allclose(np.asarray(training), np.asarray(inference), rtol=1e-3)
    np.testing.assert_array_equal(
        np.asarray(ggd_bias(*params, DISTANCES, form="inference")), np.asarray(inference)
    )


@pytest.mark.parametrize("beta", [-8.0, -30.0])
def test_inference_form_saturates_instead_of_overflowing(beta: float) -> None:
    alpha = 0.3
    params = (jnp.full((1,), alpha), jnp.full((1,), beta), jnp.zeros((1,)))
    bias = np.asarray(ggd_bias(*params, DISTANCES, form="inference"))[0]
    d = np.abs(np.asarray(DISTANCES, np.float64))
    expected = -((d * math.exp(alpha) + GGD_EPS) ** beta)
    saturated = np.abs(expected) >= 2.0**GGD_MAX_LOG2_MAGNITUDE
    assert saturated.any() and not saturated.all()
    np.testing.assert_array_equal(bias[saturated], -(2.0**GGD_MAX_LOG2_MAGNITUDE))
    np.testing.assert_allclose(bias[~saturated], expected[~saturated], rtol=1e-6, atol=1e-30)
    grads = jax.grad(
        lambda *p: jnp.sum(ggd_bias(*p, DISTANCES, form="inference")), argnums=(0, 1, 2)
    )(*params)
    for grad in grads:
        assert np.all(np.isfinite(np.asarray(grad)))


def test_dilated_inference_form_is_the_prior_at_dilated_distances() -> None:
    params = [jnp.asarray(v, jnp.float32) for v in INFERENCE_PARAMS.values()]
    prior = GGDPrior(*params, form="inference")
    for factor in (1.0, 3.0, 250.0):
        dilated = prior.dilated(factor)
        assert dilated.form == "inference"
        np.testing.assert_allclose(
            np.asarray(dilated.bias(DISTANCES)),
            np.asarray(prior.bias(factor * DISTANCES)),
            rtol=2e-5,
        )


def test_dilated_alibi_is_alibi_at_dilated_distances() -> None:
    prior = AlibiPrior(jnp.asarray(alibi_slopes(4)))
    for factor in (1.0, 3.0, 250.0):
        np.testing.assert_allclose(
            np.asarray(prior.dilated(factor).bias(DISTANCES)),
            np.asarray(prior.bias(factor * DISTANCES)),
            rtol=1e-6,
        )


def test_an_unknown_form_is_refused() -> None:
    zeros = jnp.zeros((2,), jnp.float32)
    with pytest.raises(ValueError, match=r"form must be one of \('training', 'inference'\)"):
        GGDPrior(zeros, zeros, zeros, form="sampled")
    with pytest.raises(ValueError, match="form must be one of"):
        ggd_bias(zeros, zeros, zeros, DISTANCES, form="eval")


def test_ggd_prior_is_a_jittable_pytree() -> None:
    prior = init_ggd_prior(4, alpha_init="slope", beta_init="linear")
    assert len(jax.tree.leaves(prior)) == 3
    assert prior.num_heads == 4
    bias = jax.jit(lambda p, d: p.bias(d))(prior, jnp.arange(-5, 1))
    assert bias.shape == (4, 6) and bias.dtype == jnp.float32


def test_init_slope() -> None:
    prior = init_ggd_prior(6, alpha_init="slope", beta_init=1.0)
    np.testing.assert_allclose(np.exp(np.asarray(prior.theta_alpha_H)), alibi_slopes(6), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(prior.theta_beta_H), 1.0)
    np.testing.assert_array_equal(np.asarray(prior.theta_mu_H), 0.0)


def test_init_uniform_is_a_constant_bias() -> None:
    prior = init_ggd_prior(4, **PRIOR_PRESETS["uniform"])
    np.testing.assert_array_equal(np.asarray(prior.theta_alpha_H), 0.0)
    np.testing.assert_array_equal(np.asarray(prior.theta_beta_H), 0.0)
    np.testing.assert_array_equal(np.asarray(prior.bias(DISTANCES)), -1.0)


def test_init_constant_and_mu() -> None:
    prior = init_ggd_prior(3, alpha_init=0.25, beta_init=-0.5, mu_init=0.7)
    np.testing.assert_allclose(np.asarray(prior.theta_alpha_H), math.log(0.25), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(prior.theta_beta_H), -0.5)
    np.testing.assert_allclose(np.asarray(prior.theta_mu_H), 0.7, rtol=1e-7)


def test_init_linear() -> None:
    prior = init_ggd_prior(5, **PRIOR_PRESETS["linear"])
    np.testing.assert_allclose(np.asarray(prior.theta_beta_H), [0, 0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(np.exp(np.asarray(prior.theta_alpha_H)), alibi_slopes(5), rtol=1e-6)


def test_init_sampled_is_standard_normal_and_keyed() -> None:
    first = init_ggd_prior(512, **PRIOR_PRESETS["sampled"], key=jax.random.key(1))
    again = init_ggd_prior(512, **PRIOR_PRESETS["sampled"], key=jax.random.key(1))
    other = init_ggd_prior(512, **PRIOR_PRESETS["sampled"], key=jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(first.theta_beta_H), np.asarray(again.theta_beta_H))
    assert not np.allclose(np.asarray(first.theta_beta_H), np.asarray(other.theta_beta_H))
    assert not np.allclose(np.asarray(first.theta_alpha_H), np.asarray(first.theta_beta_H))
    for values in (first.theta_alpha_H, first.theta_beta_H):
        assert abs(float(jnp.mean(values))) < 0.2 and abs(float(jnp.std(values)) - 1.0) < 0.15


@pytest.mark.parametrize("name", sorted(PRIOR_PRESETS))
def test_every_preset_builds_a_finite_prior(name: str) -> None:
    prior = init_ggd_prior(8, **PRIOR_PRESETS[name])
    assert isinstance(prior, GGDPrior)
    for leaf in jax.tree.leaves(prior):
        assert leaf.shape == (8,) and leaf.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(prior.bias(DISTANCES))))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"alpha_init": 0.0}, "alpha_init"),
        ({"alpha_init": -1.0}, "alpha_init"),
        ({"alpha_init": "slopes"}, "alpha_init"),
        ({"beta_init": "cubic"}, "beta_init"),
    ],
)
def test_init_rejects_bad_options(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        init_ggd_prior(4, **kwargs)


def test_the_prior_curves_of_bam_eval_follow_the_model_s_form() -> None:
    from bam_eval.prior_inspect import prior_curves

    row = {"layer": 0, "head": 0, "class": "retrieval"}
    row |= {name: float(values[1]) for name, values in INFERENCE_PARAMS.items()}
    config = ModelConfig.of_size("nano", encoding="bam", prior_form="inference")
    (curve,) = prior_curves(config, [row], max_distance=100, points=20)
    prior = GGDPrior(*(jnp.float32([row[name]]) for name in INFERENCE_PARAMS), form="inference")
    expected = prior.bias(-jnp.asarray(curve["distance"], jnp.float32))[0]
    np.testing.assert_allclose(curve["bias"], np.asarray(expected), rtol=1e-6)
