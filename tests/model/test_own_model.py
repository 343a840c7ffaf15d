"""bam_jax inside decoders it does not know (tests/support/own_decoders.py: NNX and Linen,
own embedding, feed-forward and output layers, no `config`), through what a user does with
them: decoding with `prefill`, `decode_step` and `generate`, the docs' cache recipe, a
local layer's window, `jax.export` with a symbolic batch and length, a bfloat16 residual
stream, and the fused kernel's gradient under `shard_map`."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export

import bam_jax
from bam_jax.inference import ChunkedForward
from bam_jax.linen import linen_attention
from tests.support.cpu_compiler import needs_compiler
from tests.support.host_devices import host_devices_result
from tests.support.own_decoders import (
    CONFIG,
    FIRST_WINDOW,
    HEADS,
    VOCAB,
    WIDTH,
    LinenDecoder,
    NNXDecoder,
    empty_cache,
    linen_as_nnx,
)

PROMPT, TOTAL = 13, 17


def tokens_of(batch: int, length: int, seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, VOCAB)


class UnreadConfigDecoder(NNXDecoder):
    """A decoder whose `config` is its own business: decoding it with a cache or a cache
    factory must not read it."""

    @property
    def config(self):
        raise AssertionError("model.config was read although a cache or a factory was given")


def own_model(kind: str, **options) -> nnx.Module:
    """The NNX decoder, or the Linen one with its variables under nnx.bridge.ToNNX."""
    if kind == "nnx":
        return NNXDecoder(nnx.Rngs(0), **options)
    if kind == "nnx_unread_config":
        return UnreadConfigDecoder(nnx.Rngs(0), **options)
    return linen_as_nnx(LinenDecoder(**options), tokens_of(1, 8))


def forward(model: nnx.Module, tokens_BxT: jax.Array) -> jax.Array:
    return nnx.jit(lambda m, t: m(t))(model, tokens_BxT)


@pytest.mark.parametrize("kind", ["nnx_unread_config", "linen"])
def test_prefill_decode_and_generate_take_a_model_without_a_config(kind):
    model = own_model(kind)
    tokens_BxT = tokens_of(2, TOTAL)
    full_BxTxV = forward(model, tokens_BxT)
    last_BxV, cache = bam_jax.prefill(
        model, tokens_BxT[:, :PROMPT], empty_cache(2, 32), chunk_size=8
    )
    assert int(cache.length) == PROMPT
    np.testing.assert_allclose(last_BxV, full_BxTxV[:, PROMPT - 1], atol=1e-5)
    for t in range(PROMPT, TOTAL):
        last_BxV, cache = bam_jax.decode_step(model, tokens_BxT[:, t : t + 1], cache)
        np.testing.assert_allclose(last_BxV, full_BxTxV[:, t], atol=1e-5)

    prompt_BxT = tokens_BxT[:, :6]
    new_BxN = bam_jax.generate(model, prompt_BxT, max_new_tokens=5, cache_factory=empty_cache)
    logits_BxTxV = forward(model, jnp.concatenate([prompt_BxT, new_BxN], axis=1))
    np.testing.assert_array_equal(new_BxN, jnp.argmax(logits_BxTxV[:, 5:10], axis=-1))
    given = bam_jax.generate(model, prompt_BxT, max_new_tokens=5, cache=empty_cache(2, 16))
    np.testing.assert_array_equal(given, new_BxN)
    without_config = own_model("nnx" if kind.startswith("nnx") else kind)
    with pytest.raises(TypeError, match=r"has no bam_jax ModelConfig.*pass cache_factory="):
        bam_jax.generate(without_config, prompt_BxT, max_new_tokens=5)


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_the_docs_cache_recipe_with_one_buffer_for_every_layer_prefills(kind):
    model = own_model(kind)
    tokens_BxT = tokens_of(2, PROMPT)
    shape = (2, 32, 4, 8)
    aliased = bam_jax.KVCache(
        keys=(jnp.zeros(shape),) * 2, values=(jnp.zeros(shape),) * 2, length=jnp.int32(0)
    )
    logits_BxV, cache = bam_jax.prefill(model, tokens_BxT, aliased, chunk_size=8)
    expected_BxV, expected = bam_jax.prefill(model, tokens_BxT, empty_cache(2, 32), chunk_size=8)
    np.testing.assert_array_equal(logits_BxV, expected_BxV)
    for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(got, want)
    assert not np.array_equal(cache.keys[0], cache.keys[1]), "each layer writes its own keys"

    def aliased_factory(batch: int, capacity: int) -> bam_jax.KVCache:
        zeros = jnp.zeros((batch, capacity, 4, 8))
        return bam_jax.KVCache(keys=(zeros,) * 2, values=(zeros,) * 2, length=jnp.int32(0))

    scored = ChunkedForward(model, aliased_factory, chunk_size=8)
    expected_loss = ChunkedForward(model, empty_cache, chunk_size=8)
    np.testing.assert_array_equal(
        scored.next_token_loss(tokens_BxT), expected_loss.next_token_loss(tokens_BxT)
    )


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_a_local_layer_sees_the_window_before_the_token_and_the_token(kind):
    model = own_model(kind, n_layers=1)  # one layer: position 9 reads positions 9 - w .. 9
    tokens_1xT = tokens_of(1, 12)
    logits_at_9 = forward(model, tokens_1xT)[0, 9]
    for position, changes in ((9 - FIRST_WINDOW - 1, False), (9 - FIRST_WINDOW, True)):
        changed_1xT = tokens_1xT.at[0, position].set((tokens_1xT[0, position] + 1) % VOCAB)
        moved = not np.allclose(forward(model, changed_1xT)[0, 9], logits_at_9, atol=1e-6)
        assert moved == changes, f"token {position} {'must' if changes else 'must not'} matter"


SYMBOLIC_TOKENS = jax.ShapeDtypeStruct(export.symbolic_shape("b, t"), jnp.int32)


def exported_nnx(model: nnx.Module):
    """The flat-leaves pattern of docs/library.md: a function of the state's arrays, which
    jax.export serialises (flax's Variable types are not registered for it). Returns the
    arrays, the exported function and the forward it exports."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)

    def logits(leaves, tokens_BxT):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))(tokens_BxT)

    return leaves, export.export(jax.jit(logits))(leaves, SYMBOLIC_TOKENS), jax.jit(logits)


def exported_linen(decoder: LinenDecoder):
    """Plain arrays: the bridged layers' metadata boxes are not registered for jax.export."""
    variables = nn.meta.unbox(jax.jit(decoder.init)(jax.random.key(0), tokens_of(1, 8)))
    apply = jax.jit(decoder.apply)
    return variables, export.export(apply)(variables, SYMBOLIC_TOKENS), apply


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_export_with_a_symbolic_batch_and_length(kind):
    exporting = exported_nnx(own_model("nnx")) if kind == "nnx" else exported_linen(LinenDecoder())
    weights, exported, direct = exporting
    reloaded = export.deserialize(exported.serialize())
    assert [str(size) for size in reloaded.in_avals[-1].shape] == ["b", "t"]
    for batch, length in ((1, 5), (3, 300)):  # 300 > the 256-key tile of blockwise attention
        tokens_BxT = tokens_of(batch, length)
        logits_BxTxV = reloaded.call(weights, tokens_BxT)
        assert logits_BxTxV.shape == (batch, length, VOCAB)
        np.testing.assert_allclose(logits_BxTxV, direct(weights, tokens_BxT), atol=2e-5)


@needs_compiler
@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_exporting_the_fused_kernel_with_symbolic_shapes_says_what_to_export(kind):
    with pytest.raises(ValueError, match=r"symbolic dimensions.*implementation='blockwise'"):
        if kind == "nnx":
            exported_nnx(own_model("nnx", implementation="fused"))
        else:
            exported_linen(LinenDecoder(implementation="fused"))


def op_dtypes(jaxpr, names: tuple[str, ...], shape: tuple[int, ...] | None = None) -> set[str]:
    """The dtypes of a jaxpr's ops called `names` (of that shape, if given), nested ones too."""
    dtypes = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in names:
            outs = [v.aval for v in eqn.outvars if shape is None or v.aval.shape == shape]
            dtypes.update(str(aval.dtype) for aval in outs)
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    dtypes |= op_dtypes(inner, names, shape)
    return dtypes


def attention_layer(kind: str, dtype, x_BxTxE: jax.Array) -> jax.Array:
    """One attention layer of `dtype` applied to x, as `bam_jax.Attention` or through
    `linen_attention` (abstractly: only the output's type is needed)."""
    config = CONFIG.replace(dtype=dtype)
    if kind == "nnx":
        return jax.eval_shape(lambda x: bam_jax.Attention(config, rngs=nnx.Rngs(0))(x), x_BxTxE)
    layer = linen_attention(config)
    return jax.eval_shape(lambda x: layer.init_with_output(jax.random.key(0), x)[0], x_BxTxE)


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_a_bfloat16_decoder_stays_bfloat16_with_float32_attention_inside(kind):
    batch, length = 2, 24
    tokens_BxT = tokens_of(batch, length)
    full, half = (own_model(kind, dtype=dtype) for dtype in ("float32", "bfloat16"))
    graphdef, state = nnx.split(half)
    jaxpr = jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens_BxT)
    assert jaxpr.out_avals[0].dtype == jnp.bfloat16
    residual = (batch, length, WIDTH)
    assert op_dtypes(jaxpr.jaxpr, ("add",), residual) == {"bfloat16"}, "the residual stream"
    transcendental = ("exp", "exp2", "log", "pow")
    assert op_dtypes(jaxpr.jaxpr, transcendental) == {"float32"}, "softmax and prior"
    half_BxTxV, full_BxTxV = forward(half, tokens_BxT), forward(full, tokens_BxT)
    assert half_BxTxV.dtype == jnp.bfloat16 and full_BxTxV.dtype == jnp.float32
    error = np.abs(np.asarray(half_BxTxV, np.float32) - full_BxTxV).max() / full_BxTxV.std()
    assert error < 0.1, f"bfloat16 logits off by {error:.3f} standard deviations"
    for layer_dtype in ("bfloat16", "float32"):  # the output follows the input
        for x_dtype in (jnp.bfloat16, jnp.float32):
            x_BxTxE = jnp.ones(residual, x_dtype)
            assert attention_layer(kind, layer_dtype, x_BxTxE).dtype == x_dtype


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_dtype_objects_are_taken_where_dtype_names_are(kind):
    x_BxTxE = jnp.ones((1, 8, WIDTH), jnp.bfloat16)
    for dtype in (jnp.bfloat16, np.dtype("bfloat16"), "bfloat16"):
        assert CONFIG.replace(dtype=dtype).dtype == "bfloat16"
        assert attention_layer(kind, dtype, x_BxTxE).dtype == jnp.bfloat16
    layer = bam_jax.Attention.of_spec(WIDTH, HEADS, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    assert layer.config.dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"dtype must be one of \('float32', 'bfloat16'\)"):
        CONFIG.replace(dtype=jnp.float16)


SHARD_MAP_CHECK = """
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P
import bam_jax
from bam_jax.inference import ChunkedForward
from bam_jax.linen import linen_attention
from tests.support.own_decoders import VOCAB, LinenDecoder, NNXDecoder

mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
tokens = jax.random.randint(jax.random.key(1), (4, 73), 0, VOCAB)  # 72 inputs: the kernel runs


def cross_entropy(logits_BxTxV, tokens_BxT):
    log_p = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(log_p, tokens_BxT[:, 1:, None], -1))


def compare(loss, positional, rest):
    # Only the prior and the SSMax scales are differentiated; the weights are closed over.
    def per_device(positional, rest, tokens):
        return jax.lax.pmean(loss(positional, rest, tokens), "data")

    sharded = jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P()
    )
    got = jax.jit(jax.grad(sharded))(positional, rest, tokens)
    want = jax.jit(jax.grad(loss))(positional, rest, tokens)
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    return [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in pairs]


model = NNXDecoder(nnx.Rngs(0), implementation="fused")
graphdef, positional, rest = nnx.split(model, nnx.Any(bam_jax.PriorParam, bam_jax.SSMaxParam), ...)


def nnx_loss(positional, rest, tokens):
    return cross_entropy(nnx.merge(graphdef, positional, rest)(tokens[:, :-1]), tokens)


decoder = LinenDecoder(implementation="fused")
variables = jax.jit(decoder.init)(jax.random.key(0), tokens[:, :-1])
linen_positional = {k: variables[k] for k in ("prior_params", "ssmax_params")}
linen_rest = {k: v for k, v in variables.items() if k not in linen_positional}


def linen_loss(positional, rest, tokens):
    return cross_entropy(decoder.apply({**rest, **positional}, tokens[:, :-1]), tokens)


results = {
    "nnx": compare(nnx_loss, positional, rest),
    "linen": compare(linen_loss, linen_positional, linen_rest),
}
print("RESULT" + json.dumps(results))
"""


@needs_compiler
def test_the_fused_kernels_prior_gradient_under_shard_map():
    results = host_devices_result(SHARD_MAP_CHECK)
    for kind in ("nnx", "linen"):
        assert len(results[kind]) == 2 * 3, results  # 2 layers: theta_alpha, theta_beta, scale
        np.testing.assert_array_less(results[kind], 1e-4)


def test_prefill_under_jit_says_it_runs_eagerly():
    model = own_model("nnx")
    with pytest.raises(TypeError, match="eagerly by design"):
        nnx.jit(bam_jax.prefill)(model, tokens_of(2, PROMPT), empty_cache(2, 32))


def test_a_layer_from_a_spec_with_a_spec_field_says_where_it_goes():
    with pytest.raises(TypeError, match=r"spec=bam_jax\.AttentionSpec\(window=16\)"):
        bam_jax.Attention.of_spec(32, 4, rngs=nnx.Rngs(0), window=16)
