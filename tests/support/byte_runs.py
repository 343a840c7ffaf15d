"""Small byte-level training runs on word corpora, for the training tests."""

import json

import numpy as np

from bam_configs.presets import preset
from bam_configs.training import DataConfig, TrainConfig

SHORT_RUN_STEPS = 4

WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "green", "blue", "sun", "sky")


def write_word_corpus(tmp_path_factory, n_documents: int) -> str:
    """A .jsonl file of `n_documents` short documents of random words (seed 0)."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    with open(path, "w") as f:
        for _ in range(n_documents):
            words = rng.choice(WORDS, size=int(rng.integers(5, 30)))
            f.write(json.dumps({"text": " ".join(words) + "."}) + "\n")
    return str(path)


def byte_text_config(
    corpus: str, *, seq_len: int = 64, val_rows: int = 8, **changes
) -> TrainConfig:
    """The micro preset as a byte-level model (259 ids) on a text corpus, 4 rows a step,
    logging every step; `changes` replace any other field."""
    cfg = preset("micro")
    fields = dict(
        model=cfg.model.replace(vocab_size=259, max_seq_len=seq_len),
        data=DataConfig(source="text", path=corpus, tokenizer="byte", val_rows=val_rows),
        batch_size=4,
        log_every=1,
    )
    return cfg.replace(**{**fields, **changes})


def short_run_config(corpus: str, **changes) -> TrainConfig:
    """`byte_text_config` for SHORT_RUN_STEPS steps without validation. The compiled train
    step holds the schedule, so it differs with `steps` and the lrs: short runs built here
    share one step program through the session's compilation cache."""
    return byte_text_config(corpus, **{**dict(steps=SHORT_RUN_STEPS, eval_every=0), **changes})
