"""The BAM model zoo: a Llama-style decoder in Flax NNX with every positional encoding.

Transformer(config) maps tokens [B, T] to float32 logits [B, T, V]. The module tree
mirrors the reference code's parameter names: tok_embeddings, layers[i].attention.{wq,
wk, wv, wo, seq_scale, prior}, layers[i].feed_forward.{w1, w2, w3},
layers[i].{attention_norm, ffn_norm}, norm, output and, for a global BAM prior, prior.
Linear kernels are [in, out] (the transpose of torch's weight).

The variable types, the linear layer and RMSNorm are in `bam_jax.layers`, a layer's
per-call inputs in `bam_jax.layer_inputs`, and `count_params` and `reconfigure` in
`bam_jax.model_state`.

Precision: parameters, embeddings and the residual stream are float32; `config.dtype` is
the dtype the matmuls multiply in, and wo, w2 and the output layer accumulate and return
float32 (the policy is spelled out in ModelConfig's docstring and docs/precision.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from bam_jax.attention import dot_product_attention
from bam_jax.attention_spec import AttentionSpec
from bam_jax.config import ModelConfig, attention_layer_config
from bam_jax.kv_cache import KVCache
from bam_jax.layer_inputs import LayerFactors, LayerInputs, finished_inputs, layer_slice
from bam_jax.layers import (
    PriorParam,
    RMSNorm,
    SSMaxParam,
    annotated,
    linear_layer,
    positional_variable,
)
from bam_jax.losses import output_cross_entropy
from bam_jax.positional import alibi_prior, apply_rope, sinusoidal_embedding
from bam_jax.priors import GGDPrior, Prior, init_ggd_prior

KV = tuple[jax.Array, jax.Array]


class AttentionPrior(nnx.Module):
    """The GGD prior's per-head parameters theta_alpha, theta_beta, theta_mu, each [H], and
    its form (`ModelConfig.prior_form`)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        initial = init_ggd_prior(
            config.n_heads,
            alpha_init=config.prior_alpha_init,
            beta_init=config.prior_beta_init,
            mu_init=config.prior_mu_init,
            key=rngs.params(),
        )
        self.theta_alpha = positional_variable(
            initial.theta_alpha_H, config.train_prior_alpha, PriorParam
        )
        self.theta_beta = positional_variable(
            initial.theta_beta_H, config.train_prior_beta, PriorParam
        )
        self.theta_mu = positional_variable(initial.theta_mu_H, config.train_prior_mu, PriorParam)
        self.form = config.prior_form

    def __call__(self) -> GGDPrior:
        return GGDPrior(
            self.theta_alpha[...], self.theta_beta[...], self.theta_mu[...], form=self.form
        )


# The ModelConfig fields an attention layer reads besides its sizes and encoding.
class Attention(nnx.Module):
    """Multi-head (or grouped-query) attention with the configured positional encoding.

    Standalone use: `Attention.of_spec(dim, n_heads, spec, rngs=...)`, then
    `attention(x_BxTxE, segment_ids_BxT=None)`. The Transformer passes each layer its
    finished inputs (`layer_inputs`: the prior, global or the layer's own, and the SSMax
    scale, both as training varies them). `spec` is the layer's `AttentionSpec` (None:
    `config.attention_spec(layer)`, which gives layer `layer` its window).

    Precision: the projections multiply in `config.dtype`; the prior, SSMax and softmax are
    float32, and wo accumulates in float32. The output is returned in `result_dtype`, by
    default the input's dtype (bfloat16 in, bfloat16 out, so a bfloat16 residual stream
    stays bfloat16); the Transformer's blocks take float32, for their float32 residual.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        rngs: nnx.Rngs,
        layer: int = 0,
        spec: AttentionSpec | None = None,
        result_dtype: Any = None,
    ):
        self.config = config
        self.spec = config.attention_spec(layer) if spec is None else spec
        self.result_dtype = None if result_dtype is None else jnp.dtype(result_dtype)
        q_dim, kv_dim = config.n_heads * config.head_dim, config.kv_heads * config.head_dim
        self.wq = linear_layer(config.dim, q_dim, ("embed", "q_heads"), config, rngs)
        self.wk = linear_layer(config.dim, kv_dim, ("embed", "kv_heads"), config, rngs)
        self.wv = linear_layer(config.dim, kv_dim, ("embed", "kv_heads"), config, rngs)
        self.wo = linear_layer(
            q_dim, config.dim, ("q_heads", "embed"), config, rngs, float32_result=True
        )
        self.seq_scale = (
            positional_variable(
                jnp.ones((config.n_heads,), jnp.float32), config.train_ssmax_scale, SSMaxParam
            )
            if config.ssmax
            else None
        )
        self.prior = AttentionPrior(config, rngs=rngs) if config.per_layer_prior else None

    @classmethod
    def of_spec(
        cls,
        dim: int,
        n_heads: int,
        spec: AttentionSpec | None = None,
        *,
        rngs: nnx.Rngs,
        encoding: str = "bam_ssmax",
        n_kv_heads: int | None = None,
        **fields: Any,
    ) -> Attention:
        """An attention layer on its own, with its own prior: its width, heads, encoding and
        `spec` (mask, SSMax placement, implementation, tiles; None: a global causal layer as
        a Transformer of this encoding has), and any of `ATTENTION_FIELDS` by keyword (the
        prior's initialisation and trainability, `train_ssmax_scale`, `rope_theta`,
        `dtype`)."""
        config = attention_layer_config(
            dim, n_heads, encoding=encoding, n_kv_heads=n_kv_heads, **fields
        )
        return cls(config, rngs=rngs, spec=spec)

    def layer_inputs(
        self,
        shared_prior: Prior | None = None,
        *,
        ssmax_max_count: int | jax.Array | None = None,
        ssmax_scale_factor: float | jax.Array | None = None,
        prior_dilation: float | jax.Array | None = None,
    ) -> LayerInputs:
        """This layer's finished inputs: its prior (its own, ALiBi's, or `shared_prior`, the
        global prior of a BAM model with `global_prior`), its SSMax scale and count cap.

        `ssmax_max_count` caps SSMax's key count (`dot_product_attention`);
        `ssmax_scale_factor` multiplies the learned SSMax scale (training's SSMax jitter);
        `prior_dilation` (training's prior dilation) makes the layer see every distance that
        many times longer: the BAM prior evaluated there (`GGDPrior.dilated`), ALiBi's slopes
        times it (`AlibiPrior.dilated`), RoPE's rotation at that many times every position.
        Sinusoidal embeddings are added before the layers (`LayerFactors`)."""
        return LayerInputs(
            prior=self._prior(shared_prior, prior_dilation),
            ssmax_scale_H=self._ssmax_scale(ssmax_scale_factor),
            ssmax_max_count=ssmax_max_count,
            position_scale=prior_dilation if self.config.positional.rotary else None,
        )

    def __call__(
        self,
        x_BxTxE: jax.Array,
        segment_ids_BxT: jax.Array | None = None,
        *,
        inputs: LayerInputs | None = None,
        kv: KV | None = None,
        cache_length: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, KV]:
        """Output [B, T, E]; with `kv` (the layer's cache buffers) also the updated buffers.

        `inputs` are the layer's finished prior, SSMax scale and cap (`layer_inputs`; None:
        `self.layer_inputs()`, the layer's own)."""
        cfg = self.config
        inputs = self.layer_inputs() if inputs is None else inputs
        batch, length, _ = x_BxTxE.shape
        q_BxTxHxD = self.wq(x_BxTxE).reshape(batch, length, cfg.n_heads, cfg.head_dim)
        k_BxTxKxD = self.wk(x_BxTxE).reshape(batch, length, cfg.kv_heads, cfg.head_dim)
        v_BxTxKxD = self.wv(x_BxTxE).reshape(batch, length, cfg.kv_heads, cfg.head_dim)
        offset = jnp.int32(0) if cache_length is None else cache_length
        if cfg.positional.rotary:
            positions_T = offset + jnp.arange(length, dtype=jnp.int32)
            if inputs.position_scale is not None:
                positions_T = positions_T.astype(jnp.float32) * inputs.position_scale
            q_BxTxHxD = apply_rope(q_BxTxHxD, positions_T, theta=cfg.rope_theta)
            k_BxTxKxD = apply_rope(k_BxTxKxD, positions_T, theta=cfg.rope_theta)
        if kv is not None:
            start = (0, offset, 0, 0)
            keys = jax.lax.dynamic_update_slice(kv[0], k_BxTxKxD.astype(kv[0].dtype), start)
            values = jax.lax.dynamic_update_slice(kv[1], v_BxTxKxD.astype(kv[1].dtype), start)
        else:
            keys, values = k_BxTxKxD, v_BxTxKxD
        out_BxTxHxD = dot_product_attention(
            q_BxTxHxD,
            keys.astype(q_BxTxHxD.dtype),
            values.astype(q_BxTxHxD.dtype),
            self.spec,
            prior=inputs.prior,
            ssmax_scale_H=inputs.ssmax_scale_H,
            ssmax_max_count=inputs.ssmax_max_count,
            query_segment_ids_BxT=segment_ids_BxT,
            key_segment_ids_BxS=segment_ids_BxT,
            query_offset=offset,
        )
        out_BxTxE = self.wo(out_BxTxHxD.reshape(batch, length, cfg.n_heads * cfg.head_dim))
        out_BxTxE = out_BxTxE.astype(self.result_dtype or x_BxTxE.dtype)
        return out_BxTxE if kv is None else (out_BxTxE, (keys, values))

    def _ssmax_scale(self, factor: float | jax.Array | None) -> jax.Array | None:
        if self.seq_scale is None:
            return None
        return self.seq_scale[...] if factor is None else self.seq_scale[...] * factor

    def _prior(self, prior: Prior | None, dilation: float | jax.Array | None) -> Prior | None:
        encoding = self.config.positional
        if encoding.alibi:
            alibi = alibi_prior(self.config.n_heads)
            return alibi if dilation is None else alibi.dilated(dilation)
        if not encoding.learned_prior:
            return None
        if self.prior is not None:
            prior = self.prior()
        if prior is None:
            raise ValueError(
                "Attention of a BAM config with global_prior=True has no prior of its own: "
                "pass inputs=attention.layer_inputs(prior), with the GGDPrior its layers "
                "share, or build it from config.replace(global_prior=False)"
            )
        return prior if dilation is None else prior.dilated(dilation)


class FeedForward(nnx.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        hidden = config.ffn_hidden_dim
        self.w1 = linear_layer(config.dim, hidden, ("embed", "mlp"), config, rngs)
        self.w2 = linear_layer(
            hidden, config.dim, ("mlp", "embed"), config, rngs, float32_result=True
        )
        self.w3 = linear_layer(config.dim, hidden, ("embed", "mlp"), config, rngs)

    def __call__(self, x_BxTxE: jax.Array) -> jax.Array:
        return self.w2(jax.nn.silu(self.w1(x_BxTxE)) * self.w3(x_BxTxE))


class TransformerBlock(nnx.Module):
    """Pre-norm block: x + attention(norm(x)), then h + feed_forward(norm(h))."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, layer: int = 0):
        dtype = jnp.dtype(config.dtype)
        self.attention = Attention(config, rngs=rngs, layer=layer, result_dtype=jnp.float32)
        self.feed_forward = FeedForward(config, rngs=rngs)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps, dtype)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps, dtype)

    def __call__(
        self,
        x_BxTxE: jax.Array,
        segment_ids_BxT: jax.Array | None = None,
        kv: KV | None = None,
        cache_length: jax.Array | None = None,
        inputs: LayerInputs | None = None,
    ) -> tuple[jax.Array, KV | None]:
        """(x + attention + feed-forward [B, T, E], the updated cache buffers or None);
        `inputs` as `Attention.__call__` takes them."""
        attended = self.attention(
            self.attention_norm(x_BxTxE),
            segment_ids_BxT=segment_ids_BxT,
            inputs=inputs,
            kv=kv,
            cache_length=cache_length,
        )
        if kv is not None:
            attended, kv = attended
        h_BxTxE = x_BxTxE + attended
        return h_BxTxE + self.feed_forward(self.ffn_norm(h_BxTxE)), kv


def _apply_block(
    block: TransformerBlock,
    x_BxTxE: jax.Array,
    segment_ids_BxT: jax.Array | None,
    kv: KV | None,
    cache_length: jax.Array | None,
    inputs: LayerInputs,
) -> tuple[jax.Array, KV | None]:
    return block(x_BxTxE, segment_ids_BxT, kv, cache_length, inputs)


def stacked_blocks(config: ModelConfig, rngs: nnx.Rngs) -> TransformerBlock:
    """n_layers blocks whose variables carry a leading "layers" axis, in their values and
    in their logical sharding (`scan_layers`; for a stack of a user's own, scanned with
    `nnx.scan(in_axes=(0, nnx.Carry, ...))`). Stacking blocks with a bare `nnx.vmap`
    instead leaves the sharding names one axis short: pass it
    `transform_metadata={nnx.PARTITION_NAME: "layers"}` as here."""

    @nnx.split_rngs(splits=config.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(rngs: nnx.Rngs) -> TransformerBlock:
        return TransformerBlock(config, rngs=rngs)

    return create(rngs)


class Transformer(nnx.Module):
    """Decoder-only language model; see the module docstring for the parameter tree.

    model(tokens_BxT, segment_ids_BxT=None) -> float32 logits [B, T, V]. Segment ids are
    document ids (any non-negative int); a negative id marks padding.
    model(tokens_BxC, cache=cache, num_valid=None) -> (logits [B, C, V], new cache): the
    chunk is written at cache.length; only its first `num_valid` tokens (default all)
    count towards the new length. `hidden_states` and `logits` split the forward pass
    before the output projection.

    Token ids must lie in [0, vocab_size); the model does not check them, since a check of
    traced values under jit would cost a host round trip per step. The embedding lookup
    (`nnx.Embed`, i.e. `jnp.take` in its default "fill" mode; eager and jit alike) reads an
    id >= vocab_size or < -vocab_size as a row of NaN, and the NaN then reaches every logit
    of that sequence, earlier positions and other documents included (a masked attention
    weight of 0 times NaN is NaN); other sequences of the batch are unaffected. An id in
    [-vocab_size, -1] silently reads row vocab_size + id. The data readers and tokenizers
    validate ids where data enters (`bam_jax.tokenizers.encode_checked`, the text and shard
    readers of the trainer), so only ids built by hand reach the model unchecked.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs | None = None):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.config = config
        self.tok_embeddings = nnx.Embed(
            config.vocab_size,
            config.dim,
            dtype=jnp.float32,
            param_dtype=jnp.float32,
            embedding_init=annotated(jax.nn.initializers.normal(1.0), ("vocab", "embed")),
            rngs=rngs,
        )
        if config.scan_layers:
            self.layers = stacked_blocks(config, rngs)
        else:
            self.layers = nnx.List(
                [TransformerBlock(config, rngs=rngs, layer=i) for i in range(config.n_layers)]
            )
        self.norm = RMSNorm(config.dim, config.norm_eps, jnp.dtype(config.dtype))
        self.output = linear_layer(
            config.dim, config.vocab_size, ("embed", "vocab"), config, rngs, float32_result=True
        )
        self.prior = AttentionPrior(config, rngs=rngs) if config.shared_prior else None

    def __call__(
        self,
        tokens_BxT: jax.Array,
        segment_ids_BxT: jax.Array | None = None,
        *,
        cache: KVCache | None = None,
        num_valid: int | jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, KVCache]:
        hidden = self.hidden_states(tokens_BxT, segment_ids_BxT, cache=cache, num_valid=num_valid)
        if cache is None:
            return self.logits(hidden)
        hidden_BxTxE, new_cache = hidden
        return self.logits(hidden_BxTxE), new_cache

    def logits(self, hidden_BxTxE: jax.Array) -> jax.Array:
        """float32 logits from final hidden states (any leading shape)."""
        return self.output(hidden_BxTxE).astype(jnp.float32)

    def cross_entropy_sum(
        self, hidden_BxPxE: jax.Array, targets_BxP: jax.Array, weights_BxP: jax.Array
    ) -> jax.Array:
        """sum(weights * cross-entropy of `logits(hidden)` against targets), float32, without
        materialising the [B, P, V] logits (`bam_jax.losses.output_cross_entropy`)."""
        return output_cross_entropy(
            hidden_BxPxE,
            self.output.kernel[...],
            targets_BxP,
            weights_BxP,
            compute_dtype=self.config.dtype,
        )

    def hidden_states(
        self,
        tokens_BxT: jax.Array,
        segment_ids_BxT: jax.Array | None = None,
        *,
        cache: KVCache | None = None,
        num_valid: int | jax.Array | None = None,
        layer_factors: LayerFactors | None = None,
    ) -> jax.Array | tuple[jax.Array, KVCache]:
        """The final-normed hidden states [B, T, E] (and the new cache): the forward pass
        without the output projection, for callers that need logits at a few positions.

        `layer_factors` holds the trainer's per-layer SSMax scale factors and prior
        dilations (`LayerFactors`); None leaves the model as it is."""
        cfg = self.config
        if tokens_BxT.ndim != 2:
            raise ValueError(f"tokens_BxT must be [batch, length], got shape {tokens_BxT.shape}")
        if segment_ids_BxT is not None and segment_ids_BxT.shape != tokens_BxT.shape:
            raise ValueError(
                f"segment_ids_BxT {segment_ids_BxT.shape} must match tokens {tokens_BxT.shape}"
            )
        if cache is not None and segment_ids_BxT is not None:
            raise ValueError("segment_ids_BxT is not supported together with a cache")
        if cache is None and num_valid is not None:
            raise ValueError("num_valid only applies to a forward with a cache")
        if layer_factors is not None:
            self._check_layer_factors(layer_factors)
        length = tokens_BxT.shape[1]
        offset = None if cache is None else cache.length

        h_BxTxE = self.tok_embeddings(tokens_BxT)
        if cfg.positional.absolute:
            positions_T = jnp.arange(length, dtype=jnp.int32)
            if offset is not None:
                positions_T = positions_T + offset
            if layer_factors is not None and layer_factors.prior_dilation_L is not None:
                positions_T = positions_T * jnp.max(layer_factors.prior_dilation_L)
            h_BxTxE = h_BxTxE + sinusoidal_embedding(
                positions_T, cfg.dim, theta=cfg.sinusoidal_theta
            )
        prior = None if self.prior is None else self.prior()
        layers = self._scan_layers if cfg.scan_layers else self._unrolled_layers
        h_BxTxE, kv = layers(h_BxTxE, segment_ids_BxT, cache, prior, layer_factors)
        h_BxTxE = self.norm(h_BxTxE)
        if cache is None:
            return h_BxTxE
        added = length if num_valid is None else num_valid
        return h_BxTxE, KVCache(keys=kv[0], values=kv[1], length=cache.length + added)

    def _block_fn(self) -> Callable:
        return nnx.remat(_apply_block) if self.config.remat else _apply_block

    def _check_layer_factors(self, factors: LayerFactors) -> None:
        cfg = self.config
        if factors.ssmax_scale_L is not None and not cfg.ssmax:
            raise ValueError(
                f"layer_factors.ssmax_scale_L needs an SSMax encoding, got {cfg.encoding!r}"
            )
        problem = None if factors.prior_dilation_L is None else cfg.dilation_problem()
        if problem:
            raise ValueError(f"layer_factors.prior_dilation_L: the model {problem}")
        for name in ("ssmax_scale_L", "prior_dilation_L"):
            factors_L = getattr(factors, name)
            if factors_L is not None and jnp.shape(factors_L) != (cfg.n_layers,):
                raise ValueError(
                    f"layer_factors.{name} must have shape [n_layers] = ({cfg.n_layers},), "
                    f"got {jnp.shape(factors_L)}"
                )

    def _unrolled_layers(self, h_BxTxE, segment_ids_BxT, cache, prior, layer_factors):
        apply = self._block_fn()
        offset = None if cache is None else cache.length
        keys, values = [], []
        max_counts = self.config.ssmax_max_counts()
        for i, block in enumerate(self.layers):
            inputs = finished_inputs(block, prior, layer_slice(layer_factors, i), max_counts[i])
            kv = None if cache is None else (cache.keys[i], cache.values[i])
            h_BxTxE, kv = apply(block, h_BxTxE, segment_ids_BxT, kv, offset, inputs)
            if kv is not None:
                keys.append(kv[0])
                values.append(kv[1])
        if cache is None:
            return h_BxTxE, None
        return h_BxTxE, (tuple(keys), tuple(values))

    def _scan_layers(self, h_BxTxE, segment_ids_BxT, cache, prior, layer_factors):
        apply = self._block_fn()
        offset = None if cache is None else cache.length
        # The scan reads and writes stacked [L, ...] buffers: a copy of the cache per call.
        kv = None if cache is None else (jnp.stack(cache.keys), jnp.stack(cache.values))
        finish = nnx.vmap(finished_inputs, in_axes=(0, None, 0, 0), out_axes=0)
        inputs_L = finish(self.layers, prior, layer_factors, self._stacked_ssmax_max_counts())

        @nnx.scan(in_axes=(0, nnx.Carry, None, 0, None, 0), out_axes=(nnx.Carry, 0))
        def run(block, h_BxTxE, segment_ids_BxT, kv, offset, inputs):
            return apply(block, h_BxTxE, segment_ids_BxT, kv, offset, inputs)

        h_BxTxE, kv = run(self.layers, h_BxTxE, segment_ids_BxT, kv, offset, inputs_L)
        if kv is None:
            return h_BxTxE, None
        return h_BxTxE, (tuple(kv[0]), tuple(kv[1]))

    def _stacked_ssmax_max_counts(self) -> jax.Array | None:
        """[L] int32 caps for the scanned layers (int32 max: no cap), None without caps."""
        if not self.config.ssmax_capped_layers:
            return None
        no_cap = jnp.iinfo(jnp.int32).max
        caps = [no_cap if c is None else c for c in self.config.ssmax_max_counts()]
        return jnp.asarray(caps, jnp.int32)
