"""AttentionSpec: the static part of every attention call, checked once when built."""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bam_jax import AttentionSpec, ModelConfig, dot_product_attention, init_ggd_prior
from bam_jax.attention import reference_attention
from bam_jax.blockwise import blockwise_attention
from bam_jax.fused_attention import fused_attention
from bam_jax.model import Attention

SPEC_FIELDS = tuple(field.name for field in dataclasses.fields(AttentionSpec))


def _qkv(q_len: int = 40, kv_len: int = 40, heads: int = 4, kv_heads: int = 2):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, q_len, heads, 16), jnp.float32)
    k, v = (jax.random.normal(key, (2, kv_len, kv_heads, 16), jnp.float32) for key in keys[1:])
    return q, k, v


def test_a_spec_is_hashable_and_a_jit_static_argument() -> None:
    spec = AttentionSpec(window=8, implementation="blockwise", block_q=16, block_k=16)
    assert hash(spec) == hash(AttentionSpec(**dataclasses.asdict(spec)))
    q, k, v = _qkv()
    attend = jax.jit(dot_product_attention, static_argnums=3)
    np.testing.assert_array_equal(attend(q, k, v, spec), dot_product_attention(q, k, v, spec))


def test_pallas_is_stored_as_fused() -> None:
    assert AttentionSpec(implementation="pallas") == AttentionSpec(implementation="fused")


@pytest.mark.parametrize(
    "fields, error, message",
    [
        ({"causal": "yes"}, TypeError, "causal must be a bool"),
        ({"ssmax_prior_inside": 1}, TypeError, "ssmax_prior_inside must be a bool"),
        ({"window": -1}, ValueError, "window must be None or an int >= 0"),
        ({"block_q": 0}, ValueError, "block_q must be a positive int"),
        ({"block_k": 16.0}, ValueError, "block_k must be a positive int"),
        ({"implementation": "flash"}, ValueError, "implementation must be one of"),
    ],
)
def test_a_bad_field_is_refused_when_the_spec_is_built(fields, error, message) -> None:
    with pytest.raises(error, match=message):
        AttentionSpec(**fields)
    with pytest.raises(error, match=message):
        AttentionSpec().replace(**fields)


def test_dot_product_attention_takes_a_spec_or_its_fields_not_both() -> None:
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="a spec or its fields by keyword, not both"):
        dot_product_attention(q, k, v, AttentionSpec(), causal=False)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['casual'\]"):
        dot_product_attention(q, k, v, casual=False)


@pytest.mark.parametrize("implementation", [reference_attention, blockwise_attention])
def test_implementations_refuse_anything_but_a_spec(implementation) -> None:
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"spec must be a bam_jax\.AttentionSpec"):
        implementation(q, k, v, {"causal": True})


@pytest.mark.parametrize("name", ["reference", "blockwise"])
def test_the_spec_and_the_keyword_form_give_the_same_bits(name: str) -> None:
    q, k, v = _qkv(q_len=24, kv_len=56)
    arrays = dict(
        prior=init_ggd_prior(4, alpha_init="slope", beta_init=-0.5),
        ssmax_scale_H=jnp.full((4,), 0.6),
        ssmax_max_count=30,
        query_offset=32,
    )
    fields = dict(window=20, ssmax_prior_inside=False, block_q=16, block_k=16)
    spec = AttentionSpec(**fields)
    direct = {"reference": reference_attention, "blockwise": blockwise_attention}[name]
    by_keyword = dot_product_attention(q, k, v, **arrays, **fields, implementation=name)
    np.testing.assert_array_equal(direct(q, k, v, spec, **arrays), by_keyword)


@pytest.mark.parametrize("implementation", [reference_attention, blockwise_attention])
def test_no_implementation_declares_a_field_of_the_spec(implementation) -> None:
    parameters = inspect.signature(inspect.unwrap(implementation)).parameters
    assert not set(SPEC_FIELDS) & set(parameters)
    assert list(parameters)[3] == "spec"


def test_the_fused_kernel_declares_no_field_of_the_spec() -> None:
    parameters = inspect.signature(inspect.unwrap(fused_attention)).parameters
    assert not set(SPEC_FIELDS) & set(parameters)


def test_a_model_layer_s_spec_follows_its_config() -> None:
    config = ModelConfig.of_size(
        "toy",
        encoding="bam_ssmax",
        local_layers=1,
        local_window=16,
        attention_impl="pallas",
        block_q=32,
    )
    local, global_ = (config.attention_spec(layer) for layer in range(2))
    assert (local.window, global_.window) == (16, None)
    assert local.causal and local.ssmax_prior_inside
    assert (local.implementation, local.block_q, local.block_k) == ("fused", 32, None)
    for encoding in ("alibi_ssmax", "rope_ssmax", "nope_ssmax"):
        assert not config.replace(encoding=encoding).attention_spec(1).ssmax_prior_inside
    outside = config.replace(ssmax_prior_inside=False)
    assert not outside.attention_spec(1).ssmax_prior_inside


def test_an_attention_layer_of_a_spec_is_a_model_s_layer_without_the_model() -> None:
    x_BxTxE = jax.random.normal(jax.random.key(1), (2, 24, 32), jnp.float32)
    alone = Attention.of_spec(32, 4, rngs=nnx.Rngs(0), n_kv_heads=2, prior_alpha_init="slope")
    config = ModelConfig(
        dim=32, n_heads=4, n_kv_heads=2, n_layers=1, global_prior=False, prior_alpha_init="slope"
    )
    in_a_model = Attention(config, rngs=nnx.Rngs(0))
    assert alone.spec == config.attention_spec(0)
    np.testing.assert_array_equal(alone(x_BxTxE), in_a_model(x_BxTxE))


def test_an_attention_layer_attends_as_its_spec_says() -> None:
    x_BxTxE = jax.random.normal(jax.random.key(1), (1, 24, 32), jnp.float32)
    changed_last = x_BxTxE.at[:, -1].add(1.0)
    for causal in (True, False):
        spec = AttentionSpec(causal=causal, window=None if not causal else 8)
        attention = Attention.of_spec(32, 4, spec, rngs=nnx.Rngs(0), encoding="alibi_ssmax")
        assert attention.spec == spec
        first_rows_moved = not np.allclose(
            attention(x_BxTxE)[:, :-1], attention(changed_last)[:, :-1]
        )
        assert first_rows_moved == (not causal)


def test_an_attention_layer_refuses_a_field_it_does_not_read() -> None:
    with pytest.raises(TypeError, match=r"\['n_layers'\].*prior_alpha_init.*ModelConfig"):
        Attention.of_spec(32, 4, rngs=nnx.Rngs(0), n_layers=2)
