"""Logits that turn NaN or infinite while a model is evaluated, its parameters finite: one
warning line per length, naming the model and how many samples or windows were not finite,
and results that mark them (failures, NaN perplexity)."""

from __future__ import annotations

import json
import logging
import math

import jax.numpy as jnp
import pytest
from flax import nnx

from bam_eval import api
from bam_eval.models import EvalModel
from bam_jax.config import ModelConfig
from bam_jax.model import Transformer

CONFIG = ModelConfig.of_size("nano", vocab_size=259, encoding="bam_ssmax", max_seq_len=64)
INFERENCE = api.InferenceSettings(chunk_size=32, attention="blockwise")


@pytest.fixture(scope="module")
def overflowing() -> EvalModel:
    """A model whose output weights are finite but so large that every logit overflows."""
    model = Transformer(CONFIG, rngs=nnx.Rngs(0))
    kernel = model.output.kernel
    kernel.set_value(jnp.full(kernel.get_value().shape, 3e38, jnp.float32))
    return EvalModel("huge", "huge", "reference", None, CONFIG, model, "byte")


@pytest.fixture
def warnings_logged():
    """The messages of the warnings logged on "bam.eval" during a test."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                messages.append(record.getMessage())

    logger, handler = logging.getLogger("bam.eval"), Collect()
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)


def test_non_finite_passkey_logits_are_failures_with_a_warning(overflowing, warnings_logged):
    evaluation = api.run_passkey(
        [overflowing], lengths=[0], samples=3, inference=INFERENCE, figures=False, progress=False
    )
    (entry,) = evaluation.results["huge"]
    assert entry["non_finite"] == [True] * 3 and entry["correct"] == [False] * 3
    assert entry["accuracy"] == 0.0
    assert warnings_logged == [
        f"warning: model 'huge': logits not finite for 3 of 3 samples at length "
        f"{entry['target_length']}; they count as failures"
    ]


def test_non_finite_perplexity_windows_are_nan_with_a_warning(
    overflowing, warnings_logged, tmp_path
):
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"text": "a few words of text, " * 8}) + "\n")
    evaluation = api.run_perplexity(
        [overflowing],
        str(data),
        seq_len=32,
        window=16,
        sequences=2,
        inference=INFERENCE,
        figures=False,
        progress=False,
    )
    entry = evaluation.results["huge"]
    assert all(math.isnan(p) for p in entry["perplexity"])
    assert entry["non_finite_sequences"] == [2, 2]
    assert warnings_logged == [
        "warning: model 'huge': logits not finite in 2 of 2 windows at --seq-len 32 (in up to "
        "2 of 2 sequences); their perplexity is NaN"
    ]
