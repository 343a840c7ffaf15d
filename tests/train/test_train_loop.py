"""End-to-end training on CPU: loss falls, checkpoints, exact resume, NaN stop, dry run."""

import dataclasses
import functools
import logging
import os
import pathlib
import re
import signal
import threading
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from bam_configs.presets import preset
from bam_configs.training import DataConfig
from bam_jax.io.checkpoints import load_model
from bam_jax.model import Transformer
from bam_jax.tokenizers import get_tokenizer
from bam_train import loop as train_loop
from bam_train import setup as train_setup
from bam_train.checkpoint import read_config
from bam_train.data import PasskeyRows, train_iterator
from bam_train.dry_run import dry_run
from bam_train.loop import train
from bam_train.metrics import read_metrics
from bam_train.optim import make_optimizer
from bam_train.setup import build
from bam_train.state import ModelParts
from bam_train.step import NonFiniteLossError, loss_sums
from tests.support.byte_runs import byte_text_config, write_word_corpus

STEPS = 12


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_word_corpus(tmp_path_factory, 300)


def small_config(corpus, **changes):
    """Quick steps and a loss that falls at once."""
    fields = dict(
        optim=dataclasses.replace(preset("micro").optim, lr=3e-2),
        steps=STEPS,
        eval_every=4,
        eval_batches=2,
        checkpoint_every=STEPS // 2,
    )
    return byte_text_config(corpus, **{**fields, **changes})


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, corpus):
    workdir = str(tmp_path_factory.mktemp("full"))
    result = train(small_config(corpus), workdir)
    return workdir, result


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, corpus):
    workdir = str(tmp_path_factory.mktemp("resumed"))
    first = train(small_config(corpus), workdir, stop_after=STEPS // 2)
    second = train(small_config(corpus), workdir)
    return workdir, first, second


def losses(workdir):
    return [(r["step"], r["loss"]) for r in read_metrics(workdir) if "loss" in r]


def val_losses(workdir):
    return [(r["step"], r["val_loss"]) for r in read_metrics(workdir) if "val_loss" in r]


def test_loss_falls(full_run):
    workdir, result = full_run
    curve = [loss for _, loss in losses(workdir)]
    assert result.step == STEPS and len(curve) == STEPS
    assert np.mean(curve[-3:]) < np.mean(curve[:3]) - 0.3


def test_checkpoints_and_config_are_written(full_run, corpus):
    workdir, _ = full_run
    steps = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
    assert steps == [STEPS // 2, STEPS]
    cfg, step = read_config(workdir)
    assert step == STEPS and cfg == small_config(corpus)
    assert os.path.isfile(os.path.join(workdir, "config.json"))
    assert any(f.startswith("events") for f in os.listdir(os.path.join(workdir, "tensorboard")))


def test_resume_is_exact(full_run, resumed_run):
    full_dir, full = full_run
    resumed_dir, first, second = resumed_run
    assert first.step == STEPS // 2 and second.step == STEPS
    assert losses(resumed_dir) == losses(full_dir)
    assert val_losses(resumed_dir) == val_losses(full_dir) and len(val_losses(full_dir)) == 3
    for a, b in zip(
        jax.tree.leaves(full.state.params), jax.tree.leaves(second.state.params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_load_model_returns_the_trained_weights(full_run, corpus):
    workdir, result = full_run
    config, model = load_model(workdir)
    assert config == small_config(corpus).model
    params, _ = ModelParts.from_config(config)[0].split(model)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(result.state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("lr", [1e9, pytest.param(1e38, marks=pytest.mark.slow)])
def test_non_finite_loss_leaves_a_checkpoint_that_resumes(tmp_path, corpus, lr):
    """A huge lr leaves parameters finite but so large that the next loss or gradient is
    NaN. The checkpoint named good must train on at a sane lr, and must still be there with
    keep_last=1, although a newer (bad) checkpoint was written after it."""
    workdir = str(tmp_path)
    cfg = small_config(corpus, checkpoint_every=1, eval_every=0, keep_last=1)
    train(cfg, workdir, stop_after=3)
    huge = dataclasses.replace(cfg.optim, lr=lr, prior_lr=lr, ssmax_lr=lr)
    with pytest.raises(NonFiniteLossError, match=r"last good checkpoint is step (\d+)") as error:
        train(cfg.replace(optim=huge), workdir)
    good = int(re.search(r"last good checkpoint is step (\d+)", str(error.value)).group(1))
    assert read_config(workdir)[1] == good >= 3
    sane = dataclasses.replace(cfg.optim, lr=1e-3, prior_lr=1e-3, ssmax_lr=1e-3)
    train(cfg.replace(optim=sane, steps=good + 4), workdir)
    records = losses(workdir)
    assert [step for step, _ in records] == list(range(1, good + 5))
    assert all(np.isfinite(loss) for _, loss in records)


def overflowing_optimizer(*args) -> optax.GradientTransformation:
    """The project's optimizer, with every update multiplied by infinity."""
    tx = make_optimizer(*args)

    def update(grads, state, params=None, **extra_args):
        updates, state = tx.update(grads, state, params, **extra_args)
        return jax.tree.map(lambda u: u * np.inf, updates), state

    return optax.GradientTransformationExtraArgs(tx.init, update)


def use_overflowing_optimizer(monkeypatch) -> None:
    """Builds from here on use `overflowing_optimizer`, in programs of their own."""
    monkeypatch.setattr(train_setup, "make_optimizer", overflowing_optimizer)
    fresh_cache = functools.lru_cache(train_setup._programs.__wrapped__)
    monkeypatch.setattr(train_setup, "_programs", fresh_cache)


def test_an_update_that_overflows_the_state_is_not_saved(tmp_path, corpus, monkeypatch):
    workdir = str(tmp_path)
    cfg = small_config(corpus, checkpoint_every=1, eval_every=0)
    train(cfg, workdir, stop_after=2)

    use_overflowing_optimizer(monkeypatch)
    with pytest.raises(NonFiniteLossError, match=r"update of step 3 .* checkpoint is step 2"):
        train(cfg, workdir)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1", "2"]


def test_dry_run_reports_params_and_memory(corpus):
    report = dry_run(build(small_config(corpus)))
    assert report["params"] > 10_000
    assert report["per_device_bytes"]["total"] > 0


def test_sigterm_saves_a_checkpoint_and_stops(tmp_path, corpus):
    workdir = str(tmp_path)

    def send_sigterm_after_two_steps():
        deadline = time.time() + 120
        while time.time() < deadline:
            path = pathlib.Path(workdir, "metrics.jsonl")
            if path.exists() and len(path.read_text().splitlines()) >= 2:
                break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=send_sigterm_after_two_steps)
    sender.start()
    result = train(small_config(corpus, profile_start=1, profile_steps=1), workdir)
    sender.join()
    assert result.preempted and 2 <= result.step < STEPS
    assert read_config(workdir)[1] == result.step
    assert losses(workdir)[-1][0] == result.step
    assert any(files for _, _, files in os.walk(os.path.join(workdir, "profile")))


def test_loss_at_answer_positions_equals_the_full_logits_loss():
    model_cfg = preset("micro").model.replace(vocab_size=259, max_seq_len=300)
    parts, _, _ = ModelParts.from_config(model_cfg)
    params, consts = parts.split(Transformer(model_cfg, rngs=nnx.Rngs(0)))
    passkey_rows = PasskeyRows(DataConfig(tokenizer="byte"), get_tokenizer("byte"), 300, seed=0)
    rows = [passkey_rows[i] for i in (0, 1)]
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    full = {k: v for k, v in batch.items() if k != "loss_positions"}
    loss = jax.jit(lambda b: loss_sums(parts, params, consts, b))
    (sparse_sum, sparse_n), (full_sum, full_n) = loss(batch), loss(full)
    assert float(sparse_n) == float(full_n) == 10
    np.testing.assert_allclose(float(sparse_sum), float(full_sum), rtol=1e-6)


def test_gradient_accumulation_matches_one_large_batch(corpus):
    cfg = small_config(corpus)
    one_pass = build(cfg.replace(batch_size=4))
    two_passes = build(cfg.replace(batch_size=2, tokens_per_step=4 * cfg.seq_len))
    assert two_passes.cfg.accum_steps == 2
    batch = next(train_iterator(cfg.data, cfg.seq_len, cfg.seed, one_pass.layout()))
    split = {k: v.reshape(2, 2, *v.shape[2:]) for k, v in batch.items()}
    state_a, metrics_a = one_pass.train_step(
        one_pass.init(), one_pass.global_batch(batch), one_pass.step_values
    )
    state_b, metrics_b = two_passes.train_step(
        two_passes.init(), two_passes.global_batch(split), two_passes.step_values
    )
    np.testing.assert_allclose(float(metrics_a["loss"]), float(metrics_b["loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(state_a.params), jax.tree.leaves(state_b.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_resuming_with_another_model_is_an_error(full_run, corpus):
    workdir, _ = full_run
    cfg = small_config(corpus)
    with pytest.raises(ValueError, match=r"another model .*'dim': \(32, 64\)"):
        train(cfg.replace(model=cfg.model.replace(dim=64)), workdir)


def test_steps_that_do_not_log_read_nothing_back(tmp_path, corpus, monkeypatch):
    """Metrics stay on the device between log and checkpoint steps: 12 steps logging every
    4th read them back three times, not once per step."""
    reads = []
    device_get = jax.device_get

    def counting_device_get(tree):
        if "loss" in str(jax.tree.structure(tree)):
            reads.append(tree)
        return device_get(tree)

    monkeypatch.setattr(train_loop.jax, "device_get", counting_device_get)
    cfg = small_config(corpus, log_every=4, checkpoint_every=8, eval_every=0)
    result = train(cfg, str(tmp_path))
    assert len(reads) == 3
    assert [step for step, _ in losses(str(tmp_path))] == [4, 8, 12]
    assert result.last_loss == losses(str(tmp_path))[-1][1]


def test_a_non_finite_step_between_log_steps_is_never_saved(tmp_path, corpus, monkeypatch):
    workdir = str(tmp_path)
    cfg = small_config(corpus, log_every=5, checkpoint_every=2, eval_every=0)
    train(cfg, workdir, stop_after=2)

    use_overflowing_optimizer(monkeypatch)
    with pytest.raises(NonFiniteLossError, match=r"update of step 3 .* checkpoint is step 2"):
        train(cfg, workdir)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2"]


def test_throughput_leaves_out_the_compiling_first_step(tmp_path, corpus):
    workdir = str(tmp_path)
    train(small_config(corpus, eval_every=0), workdir, stop_after=3)
    records = [r for r in read_metrics(workdir) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert "tokens_per_s" not in records[0] and "step_time_s" not in records[0]
    assert all(r["tokens_per_s"] > 0 and r["step_time_s"] > 0 for r in records[1:])


def test_data_is_read_by_threads_and_runs_stay_identical(tmp_path, corpus):
    assert DataConfig().num_threads > 0 and DataConfig().prefetch > 0
    cfg = small_config(corpus, eval_every=2)
    runs = [train(cfg, str(tmp_path / name), stop_after=4) for name in ("a", "b")]
    assert losses(str(tmp_path / "a")) == losses(str(tmp_path / "b"))
    assert val_losses(str(tmp_path / "a")) == val_losses(str(tmp_path / "b"))
    for a, b in zip(*(jax.tree.leaves(r.state.params) for r in runs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_progress_is_logged_once_per_log_step_with_a_summary_first(
    tmp_path, corpus, capsys, caplog
):
    workdir = str(tmp_path / "run")
    caplog.set_level(logging.INFO, logger="bam.train")
    train(small_config(corpus), workdir)  # log_every 1, eval_every 4
    summary = capsys.readouterr().out
    assert "parameters" in summary and "mesh" in summary and workdir in summary
    lines = [r.getMessage() for r in caplog.records if r.name == "bam.train"]
    steps = [f"{step}/{STEPS}" for step in range(1, STEPS + 1)]
    assert [line.split()[1] for line in lines if " loss " in line] == steps
    assert [line.split()[1] for line in lines if "val_loss" in line] == steps[3::4]
    later_steps = [line for line in lines if " loss " in line and line.split()[1] != steps[0]]
    assert len(later_steps) == STEPS - 1 and all("eta" in line for line in later_steps)
    assert all(r["time"] > 1.7e9 for r in read_metrics(workdir))
