"""Training presets, usable by name: `bam-train --config=tiny --workdir=DIR`.

A training preset is a whole TrainConfig (model, data, optimizer, schedule); the model sizes
it starts from are `bam_jax.config.MODEL_SIZES` ("toy", "nano", "l6" ... "l24").

- tiny: the "toy" model (bam_ssmax) on synthetic passkey data at context 128; trains on a
  laptop CPU in minutes.
- quickstart: the `bam-quickstart` run: the toy bam_ssmax model with a prior per layer
  that starts with local and flat heads, a local first layer (window 16), the second
  layer's SSMax jittered and its priors dilated in training, trained longer (5000 steps of
  32 prompts) at context 128, on the answer digits plus 16 random prompt positions per row
  (next-token prediction), with the passkey strings' share of the Mistral vocabulary.
- quickstart_paper: the quick start's model size, data, steps, batch and learning rate
  under the paper's protocol: every layer global, no SSMax jitter, cap or prior dilation,
  and BAM's prior as the authors' train.py starts it (one prior for all layers, ALiBi
  slopes, shape 1, location 0 and trained, every learning rate equal). With
  `bam-quickstart --preset quickstart_paper --encodings
  bam_ssmax,bam,alibi_ssmax,rope_ssmax,nope_ssmax --seed 0,1,2` it gives the comparison of
  the paper's recipe at the quick start's scale.
- quickstart_authors_prior, quickstart_no_dilation: the quick start without the options
  that only BAM has: BAM's prior as the authors' train.py starts it (one prior, ALiBi
  slopes, shape 1, location 0 and trained, prior learning rate equal to lr), or no prior
  dilation (NoPE has none); the rows beside BAM's in the quick-start recipe's comparison.
- quickstart_multikey: the quick start with half of its prompts multi-key (two needles
  with different nouns and keys, one asked for; bam_jax.retrieval).
- quickstart_answer_loss: the quick start's first recipe (the README's recipe table): one
  prior shared by the layers, no local layer, SSMax jitter or prior dilation, the full
  Mistral vocabulary, 3000 steps on the answer digits only.
- stdlib_bytes: the toy model (bam_ssmax) on real text at context 256: the running Python's
  standard library sources ("python-stdlib", held-out files kept for perplexity), byte
  vocabulary, next-token loss on every token, the quick start's per-layer prior without
  its local layer, SSMax jitter or prior dilation; `bam-quickstart --preset stdlib_bytes`
  trains it for each encoding and evaluates perplexity by position up to 32x the training
  length.
- paper_lm, paper_lm_copy: the paper's experiment in miniature, a byte-level language model
  on the standard library's training files (dim 128, 4 layers, 8 heads, context 256) under
  the authors' protocol: every layer global, BAM's prior as their train.py starts it,
  RAdam (0.9, 0.95) with weight decay 0.1, clipping at 1.0, no warmup, cosine decay to 0.1,
  the stream read in order, every next byte trained on. The one departure: lr 3e-3 for every
  parameter group (the authors' 1e-3 is for models of 30M parameters and more; at 1e-3 this
  model had not learned to copy after 12M bytes), the same for every encoding. paper_lm is
  the pure language model; paper_lm_copy seeds copying with 30% of the characters in
  generic copy documents (data.copy_seeding). Both are evaluated zero-shot: `bam-eval
  passkey`, `bam-eval copy` and `bam-eval perplexity` on "python-stdlib:held-out". With
  `--config.data.path` they train on any text corpus, local files or `hf:NAME`.
- micro: the "nano" model for tests and smoke runs (context 96, Mistral vocabulary).
- anchor: the configuration of the performance anchor (dim 256, 4 layers, 8 heads,
  vocabulary 32768, context 256, batch 16).
- l6_512 ... l24_1024: the authors' training recipe (docs/spec.md section 9, whose table pins
  every field) for every model size at context 512 and 1024: BAM starting as ALiBi (slopes,
  shape 1, location 0 and trained), one global prior, 589,824 tokens per optimizer step,
  20,000 steps, RAdam with decoupled weight decay 0.1, lr 1e-3 cosine-decayed to 1e-4 for
  every parameter group, no warmup, clipping at 1.0, bfloat16 compute, the token stream read
  in order, validation every 32 steps on the first 3,932,160 tokens, training from 1,000,000
  tokens after them, on pre-tokenised FineWeb shards (`python -m bam_train.shards`).

This file is also an ml_collections config file: `get_config(name)` returns the preset as a
ConfigDict whose fields can be overridden with `--config.FIELD=VALUE`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ml_collections import ConfigDict

from bam_configs.training import DataConfig, MeshConfig, OptimConfig, TrainConfig, to_config_dict
from bam_jax.config import ModelConfig
from bam_jax.io.documents import STDLIB

PAPER_SIZES = ("l6", "l8", "l12", "l15", "l18", "l24")
PAPER_CONTEXTS = (512, 1024)
PAPER_TOKENS_PER_STEP = 589_824
# The authors' validation set: the first 3,932,160 tokens (120 micro-batches of 32,768),
# then 1,000,000 tokens left unused before the training tokens start.
PAPER_VAL_TOKENS = 3_932_160
PAPER_VAL_GAP_TOKENS = 1_000_000
# Sizes that shard parameters over the devices (fsdp) instead of replicating them.
FSDP_SIZES = ("l15", "l18", "l24")


def tiny() -> TrainConfig:
    return TrainConfig(
        model=ModelConfig.of_size(
            "toy", encoding="bam_ssmax", max_seq_len=128, attention_impl="reference"
        ),
        data=DataConfig(source="passkey", tokenizer="mistral"),
        optim=OptimConfig(lr=3e-3, prior_lr=3e-3, ssmax_lr=3e-3, warmup_steps=20),
        steps=300,
        batch_size=16,
        log_every=10,
        eval_every=50,
        eval_batches=2,
        checkpoint_every=100,
    )


def quickstart() -> TrainConfig:
    """The laptop quick start (`bam-quickstart`): bam_ssmax at context 128, passkey data.

    Each layer has its own prior, starting with ALiBi slopes and shapes spread over [0, 1] (local
    and flat heads) and learning ten times faster than the weights, so local and retrieval heads
    separate within the short run. The first layer is a local layer: each query sees itself and the
    16 tokens before it (`local_layers=1, local_window=16`), so at 500x it reads the preceding
    tokens exactly as in training, and none of its heads can average over the whole prompt, a signal
    that changes with length and that the retrieval head of the second layer, which copies the key
    digit by digit, misreads. Next-token loss on 16 random prompt positions per row, besides the
    answer digits, trains the first layer's local heads to read the preceding tokens. The vocabulary
    is Mistral's cut down to the passkey strings' tokens, which halves the step time against the
    full 32768-way output layer. SSMax jitter 0.75 trains the second layer's SSMax at a scale drawn
    from [0.25, 1] of its own at each step, so its retrieval heads learn the margins that hold when
    SSMax sharpens them by log(n) at 500x, and prior dilation 500 evaluates its priors at up to 500
    times every distance, so it cannot lean on a head that reaches the needle only in short prompts
    (docs/spec.md section 4). Blockwise attention in 64 x 64 tiles skips the tiles above the causal
    diagonal (docs/benchmarks.md times the step against the reference attention).
    """
    return TrainConfig(
        model=ModelConfig.of_size(
            "toy",
            encoding="bam_ssmax",
            max_seq_len=128,
            vocab_size=128,
            global_prior=False,
            prior_alpha_init="slope",
            prior_beta_init="linear",
            local_layers=1,
            local_window=16,
            attention_impl="blockwise",
            block_q=64,
            block_k=64,
        ),
        data=DataConfig(source="passkey", tokenizer="passkey:mistral", passkey_lm_positions=16),
        optim=OptimConfig(lr=3e-3, prior_lr=3e-2, ssmax_lr=1e-2, warmup_steps=20),
        steps=5000,
        batch_size=32,
        log_every=50,
        checkpoint_every=500,
        progress_bar=True,
        ssmax_jitter=0.75,
        prior_dilation=500.0,
    )


def quickstart_paper() -> TrainConfig:
    """The quick start (model size, data, steps, batch, learning rate) under the paper's
    protocol: all layers global, no SSMax jitter, cap or prior dilation, and the prior as
    the authors' train.py starts BAM: one global prior, exp(theta_alpha) = the ALiBi slopes,
    theta_beta = 1, theta_mu = 0 and trained, prior and SSMax learning rates equal to lr."""
    cfg = quickstart()
    model = cfg.model.replace(
        local_layers=0,
        local_window=None,
        ssmax_capped_layers=0,
        global_prior=True,
        prior_alpha_init="slope",
        prior_beta_init=1.0,
        prior_mu_init=0.0,
        train_prior_mu=True,
    )
    optim = dataclasses.replace(cfg.optim, prior_lr=cfg.optim.lr, ssmax_lr=cfg.optim.lr)
    return cfg.replace(model=model, optim=optim, ssmax_jitter=0.0, prior_dilation=1.0)


def quickstart_authors_prior() -> TrainConfig:
    """The quick start with BAM's prior as the authors' train.py starts it (one prior for
    all layers, ALiBi slopes, shape 1, location 0 and trained, prior learning rate equal to
    lr): the quick-start recipe without the options only BAM's prior has."""
    cfg = quickstart()
    paper = quickstart_paper()
    prior_fields = (
        "global_prior",
        "prior_alpha_init",
        "prior_beta_init",
        "prior_mu_init",
        "train_prior_mu",
    )
    model = cfg.model.replace(**{name: getattr(paper.model, name) for name in prior_fields})
    return cfg.replace(model=model, optim=dataclasses.replace(cfg.optim, prior_lr=cfg.optim.lr))


def quickstart_no_dilation() -> TrainConfig:
    """The quick start without the prior dilation (which NoPE has no analogue of)."""
    return quickstart().replace(prior_dilation=1.0)


def quickstart_multikey() -> TrainConfig:
    """The quick start with half of its prompts multi-key: two needles with different nouns
    and keys, the question asking for one (what a passkey-only model is never taught)."""
    cfg = quickstart()
    data = dataclasses.replace(cfg.data, passkey_multikey_fraction=0.5, passkey_multikey_needles=2)
    return cfg.replace(data=data)


def quickstart_answer_loss() -> TrainConfig:
    """The quick start's first recipe (the README's recipe table): one prior shared by both
    layers, no local layer, SSMax jitter or prior dilation, the full Mistral vocabulary,
    3000 steps, loss on the answer digits only."""
    cfg = quickstart()
    return cfg.replace(
        model=dataclasses.replace(
            cfg.model, vocab_size=32768, global_prior=True, local_layers=0, local_window=None
        ),
        data=DataConfig(source="passkey", tokenizer="mistral"),
        steps=3000,
        ssmax_jitter=0.0,
        prior_dilation=1.0,
    )


def stdlib_bytes() -> TrainConfig:
    """The toy model at context 256 on the Python standard library's sources, byte-level.

    One recipe for every encoding (`bam-quickstart --preset stdlib_bytes --encodings ...`):
    the quick start's prior, learning ten times faster than the weights, with one prior per
    layer starting from ALiBi slopes and shapes spread over [0, 1] (local and flat heads),
    since the two layers of a small byte model do different jobs (reading the last bytes,
    finding a name further back); no local layer, SSMax jitter or prior dilation, so that the
    encodings differ only by their positional encoding. Rows are cut from the training
    files with document ids (attention stays inside a file) and every next byte is trained
    on; the held-out files ("python-stdlib:held-out") are never read in training.
    """
    return TrainConfig(
        model=ModelConfig.of_size(
            "toy",
            encoding="bam_ssmax",
            max_seq_len=256,
            vocab_size=259,
            global_prior=False,
            prior_alpha_init="slope",
            prior_beta_init="linear",
            attention_impl="blockwise",
            block_q=64,
            block_k=64,
        ),
        data=DataConfig(source="text", path=STDLIB, tokenizer="byte", val_rows=128),
        optim=OptimConfig(lr=3e-3, prior_lr=3e-2, ssmax_lr=1e-2, warmup_steps=50),
        steps=800,
        batch_size=32,
        log_every=50,
        eval_every=200,
        eval_batches=4,
        checkpoint_every=400,
        progress_bar=True,
    )


PAPER_LM_COPY_SEEDING = 0.3


def paper_lm() -> TrainConfig:
    """The paper's protocol as a byte-level language model on the standard library."""
    model = ModelConfig(
        vocab_size=259,
        dim=128,
        n_layers=4,
        n_heads=8,
        max_seq_len=256,
        encoding="bam_ssmax",
        global_prior=True,
        prior_alpha_init="slope",
        prior_beta_init=1.0,
        prior_mu_init=0.0,
        train_prior_mu=True,
        attention_impl="blockwise",
        block_q=64,
        block_k=64,
    )
    data = DataConfig(source="text", path=STDLIB, tokenizer="byte", shuffle=False, val_rows=256)
    return TrainConfig(
        model=model,
        data=data,
        optim=OptimConfig(
            lr=3e-3, prior_lr=3e-3, ssmax_lr=3e-3, weight_decay=0.1, numerics="torch"
        ),
        steps=20_000,
        batch_size=32,
        log_every=50,
        eval_every=500,
        eval_batches=8,
        checkpoint_every=500,
        keep_last=2,
        keep_every=1000,
        progress_bar=True,
    )


def paper_lm_copy() -> TrainConfig:
    """`paper_lm` with 30% of the characters in generic copy documents."""
    cfg = paper_lm()
    data = dataclasses.replace(cfg.data, copy_seeding=PAPER_LM_COPY_SEEDING)
    return cfg.replace(data=data)


def micro() -> TrainConfig:
    return TrainConfig(
        model=ModelConfig.of_size(
            "nano",
            vocab_size=32768,
            max_seq_len=96,
            encoding="bam_ssmax",
            attention_impl="reference",
        ),
        data=DataConfig(source="passkey", tokenizer="mistral"),
        optim=OptimConfig(lr=3e-3, prior_lr=3e-3, ssmax_lr=3e-3),
        steps=20,
        batch_size=4,
        log_every=5,
        checkpoint_every=10,
        progress_bar=False,
    )


def anchor() -> TrainConfig:
    model = ModelConfig(
        vocab_size=32768, dim=256, n_layers=4, n_heads=8, max_seq_len=256, encoding="bam_ssmax"
    )
    return TrainConfig(
        model=model,
        data=DataConfig(source="passkey", tokenizer="mistral", passkey_loss="all"),
        steps=20,
        batch_size=16,
        log_every=5,
        checkpoint_every=1000,
    )


def paper(size: str, context: int) -> TrainConfig:
    """The paper's recipe for one model size and training context."""
    fsdp = size in FSDP_SIZES
    model = ModelConfig.of_size(
        size,
        max_seq_len=context,
        encoding="bam_ssmax",
        prior_alpha_init="slope",
        prior_beta_init=1.0,
        prior_mu_init=0.0,
        train_prior_mu=True,
        dtype="bfloat16",
        attention_impl="blockwise",
        remat=fsdp,
    )
    batch_size = 64 * 512 // context
    val_rows = PAPER_VAL_TOKENS // context
    data = DataConfig(
        source="shards",
        path="data/fineweb-sample-10BT",
        shuffle=False,
        val_rows=val_rows,
        val_gap_tokens=PAPER_VAL_GAP_TOKENS,
        boundary_targets=True,
    )
    return TrainConfig(
        model=model,
        data=data,
        optim=OptimConfig(
            lr=1e-3, prior_lr=1e-3, ssmax_lr=1e-3, weight_decay=0.1, numerics="torch"
        ),
        mesh=MeshConfig(data=1, fsdp=-1) if fsdp else MeshConfig(data=-1),
        steps=20_000,
        batch_size=batch_size,
        tokens_per_step=PAPER_TOKENS_PER_STEP,
        log_every=10,
        eval_every=32,
        eval_batches=val_rows // batch_size,
        checkpoint_every=500,
        keep_last=3,
        keep_every=5000,
    )


def _paper_preset(size: str, context: int) -> Callable[[], TrainConfig]:
    return lambda: paper(size, context)


TRAINING_PRESETS: dict[str, Callable[[], TrainConfig]] = {
    "tiny": tiny,
    "quickstart": quickstart,
    "quickstart_paper": quickstart_paper,
    "quickstart_authors_prior": quickstart_authors_prior,
    "quickstart_no_dilation": quickstart_no_dilation,
    "quickstart_multikey": quickstart_multikey,
    "quickstart_answer_loss": quickstart_answer_loss,
    "stdlib_bytes": stdlib_bytes,
    "paper_lm": paper_lm,
    "paper_lm_copy": paper_lm_copy,
    "micro": micro,
    "anchor": anchor,
    **{f"{s}_{c}": _paper_preset(s, c) for s in PAPER_SIZES for c in PAPER_CONTEXTS},
}


def preset(name: str) -> TrainConfig:
    """The training preset `name`."""
    if name not in TRAINING_PRESETS:
        raise ValueError(
            f"config: unknown preset {name!r}; expected one of {sorted(TRAINING_PRESETS)}"
        )
    return TRAINING_PRESETS[name]()


def get_config(name: str = "tiny") -> ConfigDict:
    """ml_collections entry point (`--config=configs/presets.py:NAME`): the preset `name`."""
    return to_config_dict(preset(name))
