"""The Transformer: every encoding, the reference forward pass, masks, layouts, dtypes, config."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from flax import nnx

import bam_jax
from bam_jax.config import ENCODINGS, ModelConfig
from bam_jax.layers import PriorConstant, PriorParam, SSMaxParam
from bam_jax.model import Attention, Transformer
from bam_jax.model_state import count_params, reconfigure
from bam_jax.positional import apply_rope, sinusoidal_embedding
from tests.support.reference_numpy import reference_forward

# Encodings whose attention depends only on relative positions inside a document.
RELATIVE_ENCODINGS = tuple(e for e in ENCODINGS if not e.startswith("sinusoidal"))
# Our encoding names as the reference's `position_encoding`.
REFERENCE_NAMES = {e: e.replace("rope", "rotary") for e in ENCODINGS}
# One batch shape for most tests, so compiled forwards are shared between them. Row 0 packs
# a 4-token document before an 8-token one; row 1 holds the same 8 tokens, then another
# document.
FIRST = np.array([3, 14, 15, 9])
SECOND = np.array([26, 5, 35, 8, 9, 7, 9, 3])
TOKENS = jnp.array([np.concatenate([FIRST, SECOND]), np.concatenate([SECOND, FIRST])])
SEGMENTS = jnp.array([[7] * 4 + [0] * 8, [0] * 8 + [1] * 4])


def micro(encoding: str = "bam_ssmax", **overrides) -> ModelConfig:
    """The micro preset; the plain-einsum attention (cheap to compile) unless overridden."""
    return ModelConfig.of_size(
        "nano", encoding=encoding, **{"attention_impl": "reference", **overrides}
    )


def perturb_prior(model: Transformer, seed: int = 7) -> None:
    """Moves every prior parameter and SSMax scale away from its (symmetric) initial value."""
    state = nnx.state(model, nnx.Any(PriorParam, SSMaxParam, PriorConstant))
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    noisy = [x + 0.3 * rng.standard_normal(x.shape, np.float32) for x in leaves]
    nnx.update(model, jax.tree.unflatten(treedef, noisy))


@functools.cache
def built(encoding: str, **overrides) -> tuple[ModelConfig, Transformer]:
    config = micro(encoding, **overrides)
    model = Transformer(config, rngs=nnx.Rngs(3))
    perturb_prior(model)
    return config, model


@jax.jit
def _forward(graphdef, state, tokens, segments):
    return nnx.merge(graphdef, state)(tokens, segments)


def run(model: Transformer, tokens=TOKENS, segments=SEGMENTS) -> jax.Array:
    """Jitted forward; compiled once per model structure and input shape."""
    graphdef, state = nnx.split(model)
    return _forward(graphdef, state, tokens, segments)


class EncodingTest(chex.TestCase):
    """Every encoding, with and without jit, against the reference forward pass (numpy)."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*ENCODINGS)
    def test_matches_reference_forward(self, encoding):
        config, model = built(encoding)
        graphdef, state = nnx.split(model)

        @self.variant
        def forward(state, tokens, segments):
            return nnx.merge(graphdef, state)(tokens, segments)

        logits = forward(state, TOKENS, SEGMENTS)
        chex.assert_shape(logits, (2, 12, config.vocab_size))
        chex.assert_type(logits, jnp.float32)
        expected = reference_forward(
            torch_layout(model), reference_args(config), np.asarray(TOKENS), np.asarray(SEGMENTS)
        )
        np.testing.assert_allclose(logits, expected, atol=1e-4)
        if encoding in RELATIVE_ENCODINGS:
            # The 8-token document gives the same logits after another document (row 0,
            # positions 4..11) as at the start of a row (row 1).
            np.testing.assert_allclose(logits[0, 4:], logits[1, :8], atol=3e-5)


def torch_layout(model: Transformer) -> dict[str, np.ndarray]:
    """The model's weights under the reference state-dict names (Linear weights [out, in])."""
    config = model.config
    state = nnx.to_pure_dict(nnx.state(model))
    out = {
        "tok_embeddings.weight": state["tok_embeddings"]["embedding"],
        "norm.weight": state["norm"]["weight"],
        "output.weight": state["output"]["kernel"].T,
    }
    for name, value in (state.get("prior") or {}).items():
        out[f"prior.{name}"] = value.reshape(1, -1, 1, 1)
    for i in range(config.n_layers):
        layer = state["layers"][i]
        p = f"layers.{i}."
        for w in ("wq", "wk", "wv", "wo"):
            out[f"{p}attention.{w}.weight"] = layer["attention"][w]["kernel"].T
        for w in ("w1", "w2", "w3"):
            out[f"{p}feed_forward.{w}.weight"] = layer["feed_forward"][w]["kernel"].T
        out[f"{p}attention_norm.weight"] = layer["attention_norm"]["weight"]
        out[f"{p}ffn_norm.weight"] = layer["ffn_norm"]["weight"]
        if "seq_scale" in layer["attention"]:
            out[f"{p}attention.seq_scale"] = layer["attention"]["seq_scale"].reshape(1, -1, 1, 1)
        for name, value in (layer["attention"].get("prior") or {}).items():
            out[f"{p}attention.prior.{name}"] = value.reshape(1, -1, 1, 1)
    return {k: np.asarray(v) for k, v in out.items()}


def reference_args(config: ModelConfig) -> dict:
    return {
        "args": {"position_encoding": REFERENCE_NAMES[config.encoding]},
        "model_args": {
            "dim": config.dim,
            "n_layers": config.n_layers,
            "n_heads": config.n_heads,
            "n_kv_heads": config.n_kv_heads,
            "norm_eps": config.norm_eps,
            "max_seq_len": config.max_seq_len,
        },
    }


@pytest.mark.parametrize(
    "overrides",
    [
        {"encoding": "bam_ssmax", "n_kv_heads": 1, "global_prior": False},
        {"encoding": "bam", "n_kv_heads": 2, "global_prior": False},
        {"encoding": "rope_local", "max_seq_len": 5},  # the window acts within 12 tokens
    ],
    ids=str,
)
def test_variants_match_reference_forward(overrides):
    config, model = built(**overrides)
    expected = reference_forward(torch_layout(model), reference_args(config), TOKENS)
    np.testing.assert_allclose(run(model, TOKENS, None), expected, atol=1e-4)


@functools.partial(jax.jit, static_argnames="position")
def _embedding_gradient(graphdef, params, rest, tokens, segments, position):
    def output_at(params):
        return nnx.merge(graphdef, params, rest)(tokens, segments)[:, position].sum()

    grads = jax.grad(output_at)(params)
    return jnp.abs(grads["tok_embeddings"]["embedding"][...]).sum(-1)


def position_gradient(model: Transformer, segments, position: int) -> np.ndarray:
    """|d logits[0, position] / d embedding of the token at each position| (row 0 of TOKENS)."""
    tokens = jnp.arange(12)[None] * 5 % model.config.vocab_size  # distinct ids: a row per position
    segments = None if segments is None else segments[:1]
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    grads = _embedding_gradient(graphdef, params, rest, tokens, segments, position)
    return np.asarray(grads[tokens[0]])


def test_causal_and_documents_by_gradient():
    _, model = built("bam_ssmax")
    grad = position_gradient(model, SEGMENTS, position=7)
    assert np.all(grad[8:] == 0.0), "future tokens must get zero gradient"
    assert np.all(grad[:4] == 0.0), "another document must get zero gradient"
    assert np.all(grad[4:8] > 0.0)


def test_rope_local_window_blocks_distant_tokens():
    _, model = built("rope_local", n_layers=1, local_window=3)
    grad = position_gradient(model, None, position=9)
    assert np.all(grad[:6] == 0.0) and np.all(grad[6:10] > 0.0) and np.all(grad[10:] == 0.0)


def test_local_layers_see_their_window_and_global_layers_everything():
    _, local = built("bam_ssmax", n_layers=1, local_layers=1, local_window=3)
    grad = position_gradient(local, None, position=9)
    assert np.all(grad[:6] == 0.0) and np.all(grad[6:10] > 0.0) and np.all(grad[10:] == 0.0)
    _, local_then_global = built("bam_ssmax", n_layers=2, local_layers=1, local_window=3)
    assert local_then_global.config.layer_windows() == (3, None)
    grad = position_gradient(local_then_global, None, position=9)
    assert np.all(grad[:10] > 0.0) and np.all(grad[10:] == 0.0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(local_layers=3), r"local_layers must be in \[0, n_layers=2\]"),
        (dict(local_layers=-1), "local_layers must be in"),
        (dict(local_layers=True), "local_layers must be an int"),
        (dict(local_layers=1, scan_layers=True), "mixes local and global layers"),
    ],
)
def test_local_layers_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.of_size("nano", **overrides)


@pytest.mark.parametrize("overrides", [{}, {"local_layers": 1, "local_window": 3}])
def test_blockwise_attention_gives_the_same_model(overrides):
    _, model = built("bam_ssmax", **overrides)
    blockwise = reconfigure(model, attention_impl="blockwise", block_q=4, block_k=8)
    np.testing.assert_allclose(run(blockwise), run(model), atol=2e-5)


def test_padding_is_never_attended():
    _, model = built("bam_ssmax")
    padded_first = jnp.array([np.concatenate([FIRST, SECOND])] * 2)
    segments = jnp.array([[-1] * 4 + [0] * 8, [2] * 4 + [5] * 8])
    logits = run(model, padded_first, segments)
    np.testing.assert_allclose(logits[0, 4:], logits[1, 4:], atol=3e-5)
    alone = run(model, jnp.asarray(SECOND)[None], None)
    np.testing.assert_allclose(logits[0, 4:], alone[0], atol=3e-5)


def test_scan_layers_equals_unrolled():
    _, model = built("bam_ssmax", global_prior=False)
    scanned = reconfigure(model, scan_layers=True, remat=True)
    assert scanned.config.scan_layers
    np.testing.assert_allclose(run(scanned), run(model), atol=2e-5)
    back = nnx.to_pure_dict(nnx.state(reconfigure(scanned, scan_layers=False)))
    chex.assert_trees_all_equal(back, nnx.to_pure_dict(nnx.state(model)))
    spec = nnx.state(scanned)["layers"]["attention"]["wq"]["kernel"].get_metadata()
    assert spec["out_sharding"] == ("layers", "embed", "q_heads")
    fresh = Transformer(micro("rope", scan_layers=True))
    kernels = fresh.layers.attention.wq.kernel[...]
    assert kernels.shape == (2, 32, 32) and not np.allclose(kernels[0], kernels[1])


def test_capped_ssmax_layers_change_only_rows_past_the_training_context():
    _, model = built("bam_ssmax", global_prior=False, max_seq_len=8)
    plain = run(model, segments=None)
    by_capped_layers = {}
    for capped in (1, 2):
        capped_model = reconfigure(model, ssmax_capped_layers=capped)
        logits = run(capped_model, segments=None)
        np.testing.assert_array_equal(logits[:, :8], plain[:, :8])
        assert not np.allclose(logits[:, 8:], plain[:, 8:], atol=1e-4)
        scanned = run(reconfigure(capped_model, scan_layers=True), segments=None)
        np.testing.assert_allclose(scanned, logits, atol=2e-5)
        by_capped_layers[capped] = logits
    assert not np.allclose(by_capped_layers[1][:, 8:], by_capped_layers[2][:, 8:], atol=1e-4)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(ssmax_capped_layers=3), r"ssmax_capped_layers must be in \[0, n_layers=2\]"),
        (dict(ssmax_capped_layers=-1), "ssmax_capped_layers must be in"),
        (dict(ssmax_capped_layers=1.0), "ssmax_capped_layers must be an int"),
        (dict(ssmax_capped_layers=1, encoding="bam"), "needs an SSMax encoding"),
    ],
)
def test_ssmax_capped_layers_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        micro(**overrides)


@jax.jit
def _loss_and_grads(graphdef, params, rest, tokens):
    def loss(params):
        return jnp.mean(nnx.merge(graphdef, params, rest)(tokens) ** 2)

    return jax.value_and_grad(loss)(params)


def loss_and_grads(model: Transformer):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss, grads = _loss_and_grads(graphdef, params, rest, TOKENS)
    return loss, nnx.to_pure_dict(grads)


def test_remat_equals_no_remat_values_and_gradients():
    _, model = built("bam_ssmax")
    loss, grads = loss_and_grads(model)
    remat_loss, remat_grads = loss_and_grads(reconfigure(model, remat=True))
    np.testing.assert_allclose(remat_loss, loss, rtol=1e-6)
    chex.assert_trees_all_close(remat_grads, grads, atol=1e-6)
    assert np.abs(grads["prior"]["theta_alpha"]).max() > 0


def test_bfloat16_compute_is_close_to_float32():
    _, model = built("bam_ssmax")
    half = reconfigure(model, dtype="bfloat16")
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(half)))
    full_logits, half_logits = run(model), run(half)
    chex.assert_type(half_logits, jnp.float32)
    chex.assert_tree_all_finite(half_logits)
    error = jnp.abs(half_logits - full_logits).max() / jnp.abs(full_logits).max()
    assert error < 0.05, f"relative error {error}"
    assert jnp.mean(half_logits.argmax(-1) == full_logits.argmax(-1)) > 0.8


# Parameter counts of the paper sizes with vocabulary 32768 (docs/spec.md section 7).
PAPER_COUNTS = {"l6": 49e6, "l8": 98e6, "l12": 121e6, "l15": 275e6, "l18": 525e6, "l24": 1.1e9}


@pytest.mark.parametrize("name", sorted(PAPER_COUNTS))
def test_preset_parameter_counts(name):
    config = ModelConfig.of_size(name, encoding="rope")
    count = count_params(abstract_model(config))
    d, v, hidden = config.dim, config.vocab_size, config.ffn_hidden_dim
    assert count == 2 * v * d + d + config.n_layers * (4 * d * d + 3 * d * hidden + 2 * d)
    assert abs(count - PAPER_COUNTS[name]) / PAPER_COUNTS[name] < 0.04
    assert config.vocab_size == 32768 and hidden == 2 * d


def abstract_model(config: ModelConfig) -> Transformer:
    return nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))


def test_prior_and_ssmax_add_their_parameter_counts():
    base = count_params(abstract_model(micro("rope")))
    heads, layers = 4, 2
    assert count_params(abstract_model(micro("rope_ssmax"))) == base + heads * layers
    assert count_params(abstract_model(micro("bam"))) == base + 3 * heads
    per_layer = abstract_model(micro("bam_ssmax", global_prior=False))
    assert count_params(per_layer) == base + 4 * heads * layers


def test_variable_types_follow_trainability_flags():
    model = Transformer(micro("bam_ssmax", train_prior_beta=False))
    assert isinstance(model.prior.theta_alpha, PriorParam)
    assert isinstance(model.prior.theta_beta, PriorConstant)
    assert isinstance(model.prior.theta_mu, PriorConstant)
    assert not isinstance(model.prior.theta_mu, nnx.Param)
    assert isinstance(model.layers[0].attention.seq_scale, SSMaxParam)
    np.testing.assert_array_equal(model.layers[0].attention.seq_scale[...], np.ones(4))
    frozen = abstract_model(micro("nope_ssmax", train_ssmax_scale=False))
    assert isinstance(frozen.layers[1].attention.seq_scale, PriorConstant)
    # The uniform prior: theta_alpha = log(1) = 0, theta_beta = 0.
    np.testing.assert_array_equal(model.prior.theta_alpha[...], np.zeros(4))
    np.testing.assert_array_equal(model.prior.theta_beta[...], np.zeros(4))
    slope = Transformer(micro("bam", prior_alpha_init="slope", prior_beta_init="linear"))
    np.testing.assert_allclose(
        jnp.exp(slope.prior.theta_alpha[...]), 2.0 ** -(2.0 * jnp.arange(1, 5))
    )
    np.testing.assert_allclose(slope.prior.theta_beta[...], jnp.linspace(0, 1, 4))


def test_every_variable_has_logical_axis_names():
    model = abstract_model(micro("bam_ssmax", global_prior=False, n_kv_heads=2))
    expected = {
        ("tok_embeddings", "embedding"): ("vocab", "embed"),
        ("output", "kernel"): ("embed", "vocab"),
        ("norm", "weight"): ("norm",),
        ("layers", 0, "attention", "wq", "kernel"): ("embed", "q_heads"),
        ("layers", 0, "attention", "wk", "kernel"): ("embed", "kv_heads"),
        ("layers", 0, "attention", "wv", "kernel"): ("embed", "kv_heads"),
        ("layers", 0, "attention", "wo", "kernel"): ("q_heads", "embed"),
        ("layers", 0, "attention", "seq_scale"): (None,),
        ("layers", 0, "attention", "prior", "theta_beta"): (None,),
        ("layers", 0, "feed_forward", "w1", "kernel"): ("embed", "mlp"),
        ("layers", 0, "feed_forward", "w2", "kernel"): ("mlp", "embed"),
        ("layers", 0, "attention_norm", "weight"): ("norm",),
    }
    found = {}
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        sharding = variable.get_metadata().get("out_sharding")
        assert sharding is not None and len(sharding) == len(variable.shape), path
        found[path] = tuple(sharding)
    for path, axes in expected.items():
        assert found[path] == axes, path
    assert model.layers[0].attention.wk.kernel.shape == (32, 16)


def test_standalone_attention_needs_the_global_prior():
    config = micro("bam")
    attention = Attention(config, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 3, config.dim))
    with pytest.raises(ValueError, match=r"pass inputs=attention.layer_inputs\(prior\)"):
        attention(x)
    prior = Transformer(config).prior()
    chex.assert_shape(attention(x, inputs=attention.layer_inputs(prior)), (1, 3, config.dim))


def test_split_merge_and_tree_mode():
    _, model = built("bam_ssmax")
    graphdef, state = nnx.split(model)
    np.testing.assert_array_equal(run(nnx.merge(graphdef, state)), run(model))
    forward = nnx.jit(lambda m, t, s: m(t, s), graph=False)
    np.testing.assert_allclose(forward(model, TOKENS, SEGMENTS), run(model), atol=2e-5)
    doubled = jax.tree.map(lambda x: 2 * x, model)  # the module is itself a pytree
    assert doubled is not model and len(jax.tree.leaves(doubled)) == len(jax.tree.leaves(state))


def test_config_roundtrip_and_presets():
    config = ModelConfig.of_size("l12", encoding="alibi_ssmax", prior_alpha_init="slope")
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert (config.dim, config.n_layers, config.n_heads) == (768, 12, 16)
    tiny = ModelConfig.of_size("toy", vocab_size=259)
    assert tiny.vocab_size == 259 and tiny.dim == 64
    with pytest.raises(ValueError, match="model size"):
        ModelConfig.of_size("l7")
    with pytest.raises(ValueError, match=r"config: unknown field 'model\.colour'; valid fields"):
        ModelConfig.from_dict({**config.to_dict(), "colour": 1})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("encoding", "xpos"),
        ("dim", 30),  # not divisible by n_heads = 4
        ("n_kv_heads", 3),  # n_heads = 4 not divisible by 3
        ("dtype", "float16"),
        ("attention_impl", "flash"),
        ("vocab_size", 0),
        ("dim", -32),
        ("n_layers", 0),
        ("n_heads", 0),
        ("n_kv_heads", 0),
        ("multiple_of", 0),
        ("max_seq_len", 0),
        ("block_q", 0),
        ("block_k", -1),
        ("local_window", -1),
        ("ffn_dim_multiplier", 0.0),
        ("norm_eps", -1e-5),
        ("rope_theta", 0),
        ("sinusoidal_theta", 0),
        ("prior_alpha_init", "linear"),
        ("prior_alpha_init", -1.0),
        ("prior_beta_init", "slope"),
        ("prior_mu_init", "zero"),
        ("remat", "yes"),
        ("scan_layers", 1),
        ("global_prior", None),
        ("train_prior_alpha", "true"),
        ("ssmax_prior_inside", 0),
        ("norm_eps", float("nan")),
        ("rope_theta", float("inf")),
        ("ffn_dim_multiplier", 1e39),
        ("prior_mu_init", float("inf")),
        ("prior_alpha_init", float("nan")),
        ("prior_beta_init", -1e39),
    ],
)
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        micro(**{field: value})


def test_rope_is_relative_and_uses_adjacent_pairs():
    x, y = np.random.default_rng(0).standard_normal((2, 1, 1, 1, 8), np.float32)

    @jax.jit
    def score(p, q):
        rx = apply_rope(x, jnp.array([p]), theta=500000.0)
        ry = apply_rope(y, jnp.array([q]), theta=500000.0)
        return jnp.sum(rx * ry)

    np.testing.assert_allclose(score(3, 1), score(12, 10), rtol=1e-5)
    rotated = apply_rope(x, jnp.array([1]), theta=500000.0)[0, 0, 0]
    expected = (x[0, 0, 0, 0] + 1j * x[0, 0, 0, 1]) * np.exp(1j * 1.0)  # pair 0: frequency 1
    np.testing.assert_allclose([rotated[0], rotated[1]], [expected.real, expected.imag], rtol=1e-5)


def test_sinusoidal_uses_odd_index_in_cosine_frequency():
    table = sinusoidal_embedding(jnp.arange(5), 8, theta=10000.0)
    p = 3.0
    np.testing.assert_allclose(table[3, 2], np.sin(p * 10000 ** (-2 / 8)), rtol=1e-5)
    np.testing.assert_allclose(table[3, 3], np.cos(p * 10000 ** (-3 / 8)), rtol=1e-5)
    np.testing.assert_allclose(table[0], np.tile([0.0, 1.0], 4))


def test_stacked_blocks_scan_with_the_layers_axis_in_their_sharding():
    config = micro("bam_ssmax", n_layers=3, global_prior=False)
    blocks = bam_jax.stacked_blocks(config, nnx.Rngs(0))
    kernel = blocks.attention.wq.kernel
    assert kernel.shape[0] == 3
    assert kernel.get_metadata()["out_sharding"][0] == "layers"

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def run(block, h_BxTxE):
        return block(h_BxTxE)[0]

    chex.assert_shape(run(blocks, jnp.ones((1, 5, config.dim))), (1, 5, config.dim))
