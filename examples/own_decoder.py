"""BAM attention inside decoders of your own: one written in Flax NNX, one in Flax Linen,
each trained on a copy task with the batch sharded over a mesh of 4 host devices.

    python examples/own_decoder.py --steps 300

Each row holds 16 random tokens, a separator, then the same 16 tokens again; the loss is on
the copy, which a model can only learn by attending to the token 17 positions back. The
decoders use `bam_jax.Attention` (NNX) and `bam_jax.linen.linen_attention` (Linen) with a
BAM prior per layer and SSMax; everything else (embedding, norms, MLP, output layer,
optimizer) is plain Flax and optax. The prior and the SSMax scales train at their own rate
without weight decay, through `bam_jax.optimizer_labels` and `bam_jax.linen.linen_labels`.
The script prints each decoder's first and last loss and how far its prior moved.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import flax.linen as nn
import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import bam_jax
from bam_jax.linen import linen_attention, linen_labels, trainable

HALF, VOCAB, DIM, HEADS, LAYERS, BATCH = 16, 32, 64, 4, 2, 32
CONFIG = bam_jax.ModelConfig(
    dim=DIM,
    n_heads=HEADS,
    vocab_size=VOCAB,
    max_seq_len=2 * HALF + 1,
    encoding="bam_ssmax",
    global_prior=False,
    attention_impl="blockwise",
)


def optimizer(lr: float) -> dict[str, optax.GradientTransformation]:
    """The groups' transforms: weight decay on matrices only, the prior ten times faster."""
    return {
        "decay": optax.adamw(lr, weight_decay=0.1),
        "no_decay": optax.adam(lr),
        "prior": optax.adam(10 * lr),
        "ssmax": optax.adam(lr),
    }


def copy_batch(rng: np.random.Generator) -> np.ndarray:
    """[BATCH, 2 * HALF + 1] tokens: HALF random ones (1..VOCAB-1), a 0, then the same."""
    first = rng.integers(1, VOCAB, size=(BATCH, HALF))
    return np.concatenate([first, np.zeros((BATCH, 1), int), first], axis=1).astype(np.int32)


def copy_loss(logits_BxTxV: jax.Array, tokens_BxT: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting the copied half."""
    predicted = logits_BxTxV[:, HALF:-1]
    return optax.softmax_cross_entropy_with_integer_labels(
        predicted, tokens_BxT[:, HALF + 1 :]
    ).mean()


class NnxBlock(nnx.Module):
    def __init__(self, layer: int, rngs: nnx.Rngs):
        self.norm1, self.norm2 = nnx.RMSNorm(DIM, rngs=rngs), nnx.RMSNorm(DIM, rngs=rngs)
        self.attention = bam_jax.Attention(CONFIG, rngs=rngs, layer=layer)
        self.up, self.down = (
            nnx.Linear(DIM, 4 * DIM, rngs=rngs),
            nnx.Linear(4 * DIM, DIM, rngs=rngs),
        )

    def __call__(self, x_BxTxE: jax.Array) -> jax.Array:
        x_BxTxE = x_BxTxE + self.attention(self.norm1(x_BxTxE))
        return x_BxTxE + self.down(jax.nn.gelu(self.up(self.norm2(x_BxTxE))))


class NnxDecoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.blocks = nnx.List([NnxBlock(layer, rngs) for layer in range(LAYERS)])
        self.norm, self.out = nnx.RMSNorm(DIM, rngs=rngs), nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        x_BxTxE = self.embed(tokens_BxT)
        for block in self.blocks:
            x_BxTxE = block(x_BxTxE)
        return self.out(self.norm(x_BxTxE))


class LinenDecoder(nn.Module):
    @nn.compact
    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        x_BxTxE = nn.Embed(VOCAB, DIM)(tokens_BxT)
        for layer in range(LAYERS):
            x_BxTxE = x_BxTxE + linen_attention(CONFIG, name=f"attention{layer}")(
                nn.RMSNorm()(x_BxTxE)
            )
            hidden = nn.gelu(nn.Dense(4 * DIM)(nn.RMSNorm()(x_BxTxE)))
            x_BxTxE = x_BxTxE + nn.Dense(DIM)(hidden)
        return nn.Dense(VOCAB)(nn.RMSNorm()(x_BxTxE))


def train_nnx(batches: list[jax.Array], lr: float) -> tuple[list[float], float]:
    """Losses over the steps and the largest change of any theta_alpha."""
    model = NnxDecoder(nnx.Rngs(0))
    labels = bam_jax.optimizer_labels(model)
    opt = nnx.Optimizer(model, optax.multi_transform(optimizer(lr), labels), wrt=nnx.Param)
    start = np.stack([np.asarray(b.attention.prior.theta_alpha[...]) for b in model.blocks])

    @nnx.jit
    def step(model: NnxDecoder, opt: nnx.Optimizer, tokens_BxT: jax.Array) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda m: copy_loss(m(tokens_BxT), tokens_BxT))(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, tokens)) for tokens in batches]
    end = np.stack([np.asarray(b.attention.prior.theta_alpha[...]) for b in model.blocks])
    return losses, float(np.max(np.abs(end - start)))


def train_linen(batches: list[jax.Array], lr: float) -> tuple[list[float], float]:
    """Losses over the steps and the largest change of any theta_alpha."""
    module = LinenDecoder()
    variables = module.init(jax.random.key(0), batches[0])
    params = trainable(variables)
    tx = optax.multi_transform(optimizer(lr), linen_labels)
    state = tx.init(params)

    @jax.jit
    def step(params, state, tokens_BxT):
        def loss_fn(params):
            return copy_loss(module.apply({**variables, **params}, tokens_BxT), tokens_BxT)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    start = _linen_alphas(params)
    losses = []
    for tokens in batches:
        params, state, loss = step(params, state, tokens)
        losses.append(float(loss))
    return losses, float(np.max(np.abs(_linen_alphas(params) - start)))


def _linen_alphas(params: dict) -> np.ndarray:
    leaves = jax.tree_util.tree_leaves_with_path(params["prior_params"])
    return np.stack(
        [np.asarray(x) for path, x in leaves if "theta_alpha" in jax.tree_util.keystr(path)]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    rows = NamedSharding(mesh, PartitionSpec("data"))
    rng = np.random.default_rng(0)
    batches = [jax.device_put(copy_batch(rng), rows) for _ in range(args.steps)]
    print(f"{len(jax.devices())} devices, batch of {BATCH} split over {rows.spec}")
    for name, train in (("nnx", train_nnx), ("linen", train_linen)):
        losses, prior_moved = train(batches, args.lr)
        print(
            f"{name}: copy loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps; "
            f"theta_alpha moved by up to {prior_moved:.3f}"
        )


if __name__ == "__main__":
    main()
