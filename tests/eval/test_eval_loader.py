"""The params-only loader of a training workdir: the parameters of the full training state,
read without building the optimizer the run's config names."""

from __future__ import annotations

import dataclasses
import logging
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from bam_configs.presets import preset
from bam_configs.training import DataConfig
from bam_eval import api, models
from bam_jax.io.checkpoints import load_model, load_params
from bam_train.checkpoint import Checkpointer
from bam_train.optim import make_optimizer
from bam_train.state import ModelParts, init_state


def _config():
    cfg = preset("micro")
    return cfg.replace(
        model=cfg.model.replace(vocab_size=259, max_seq_len=64),
        data=DataConfig(source="passkey", tokenizer="byte"),
    )


def _save(path, cfg, tx: optax.GradientTransformation, saved_config: dict, step: int = 5):
    parts, _, _ = ModelParts.from_config(cfg.model)
    state = init_state(cfg.model, parts, tx, seed=7)
    noise = jax.tree.map(lambda x: 0.01 * np.arange(x.size).reshape(x.shape), state.params)
    state = state.replace(params=jax.tree.map(lambda x, n: x + n, state.params, noise))
    checkpointer = Checkpointer(str(path), cfg)
    checkpointer.save(step, state, {}, saved_config)
    checkpointer.close()
    return state


def _assert_same_tree(restored, expected) -> None:
    restored_leaves = jax.tree_util.tree_leaves_with_path(restored)
    expected_leaves = jax.tree_util.tree_leaves_with_path(expected)
    assert len(restored_leaves) == len(expected_leaves)
    for (path, a), (_, b) in zip(restored_leaves, expected_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def test_params_only_load_equals_the_saved_training_state(tmp_path) -> None:
    cfg = _config()
    parts, _, _ = ModelParts.from_config(cfg.model)
    state = _save(tmp_path / "run", cfg, make_optimizer(cfg.optim, parts.labels), cfg.to_dict())
    saved = load_params(tmp_path / "run")
    assert saved.step == 5 and saved.config == cfg.model
    _assert_same_tree(saved.params, state.params)
    _assert_same_tree(saved.consts, state.consts)
    config, model = load_model(tmp_path / "run", step=5)
    params, consts = parts.split(model)
    _assert_same_tree(params, state.params)
    _assert_same_tree(consts, state.consts)
    assert config == cfg.model and isinstance(model, nnx.Module)


@pytest.mark.parametrize("saved_optimizer", ["sgd", "no optimizer state"])
def test_optimizer_state_is_never_read(tmp_path, saved_optimizer) -> None:
    # The saved optimizer state matches neither the optimizer the config names nor any
    # other: a loader that restored it would fail.
    cfg = _config()
    tx = optax.sgd(0.1) if saved_optimizer == "sgd" else optax.identity()
    optim = dataclasses.replace(cfg.optim, weight_decay=0.0, clip_norm=0.0)
    saved_config = cfg.replace(optim=optim)
    state = _save(tmp_path / "run", cfg, tx, saved_config.to_dict())
    saved = load_params(tmp_path / "run")
    _assert_same_tree(saved.params, state.params)
    _assert_same_tree(saved.consts, state.consts)


@pytest.fixture
def live_run(tmp_path, monkeypatch):
    """A run with checkpoints 5 and 9 whose training deletes checkpoint 9 (retention) while
    an evaluation reads it."""
    cfg = _config()
    parts, _, _ = ModelParts.from_config(cfg.model)
    for step in (5, 9):
        _save(tmp_path / "run", cfg, make_optimizer(cfg.optim, parts.labels), cfg.to_dict(), step)
    read = models.load_params

    def read_while_retention_deletes(workdir, step=None):
        if step == 9:
            shutil.rmtree(tmp_path / "run" / "checkpoints" / "9")
        return read(workdir, step)

    monkeypatch.setattr(models, "load_params", read_while_retention_deletes)
    return str(tmp_path / "run")


def test_a_checkpoint_deleted_while_read_gives_way_to_the_newest_left(live_run, caplog):
    with caplog.at_level(logging.WARNING, logger="bam.eval"):
        [model] = api.load_models([live_run])
    assert model.step == 5
    [line] = caplog.messages
    assert line.endswith(
        "was removed while it was read (the run is still training); evaluating step 5 instead"
    )


def test_a_requested_step_deleted_while_read_is_an_error(live_run):
    removed = r"checkpoints/9 was removed while it was read .*@STEP \(steps: \[5\]\)"
    with pytest.raises(ValueError, match=removed):
        api.load_models([f"{live_run}@9"])
