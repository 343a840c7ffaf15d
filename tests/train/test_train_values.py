"""The train step takes the run's numbers (learning rates, warmup, steps, seed, jitter,
dilation) as values: a sweep over them compiles one step, a resumed run takes its new
values, and checkpoints written before the step took values still resume."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

from bam_configs.training import TrainConfig
from bam_jax.io.checkpoints import load_params
from bam_train.data import train_iterator
from bam_train.loop import train
from bam_train.metrics import read_metrics
from bam_train.optim import learning_rates
from bam_train.setup import build, program_config
from tests.support import REPO_ROOT
from tests.support.byte_runs import short_run_config, write_word_corpus

# A run of the `quickstart` preset at dim 16, 2 steps of 2 rows a checkpoint, written by
# bam-jax 0.1.0 before the step took values (checkpoints at steps 2 and 4, its metrics).
RELEASE_RUN = REPO_ROOT / "tests" / "data" / "checkpoint_0_1_0"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_word_corpus(tmp_path_factory, 200)


def with_optim(cfg: TrainConfig, **changes) -> TrainConfig:
    return cfg.replace(optim=dataclasses.replace(cfg.optim, **changes))


def sweep_configs(cfg: TrainConfig) -> list[TrainConfig]:
    """Four runs that differ in every number the step takes as a value."""
    return [
        cfg,
        with_optim(cfg, lr=3e-2, prior_lr=1e-1).replace(steps=9, seed=3),
        with_optim(cfg, lr=1e-4, warmup_steps=2, final_lr_fraction=0.5),
        with_optim(cfg, ssmax_lr=5e-2).replace(steps=40, seed=11),
    ]


def test_a_learning_rate_sweep_compiles_one_train_step(corpus):
    configs = sweep_configs(short_run_config(corpus))
    setups = [build(cfg) for cfg in configs]
    assert all(setup.train_step is setups[0].train_step for setup in setups)
    batch = next(train_iterator(configs[0].data, configs[0].seq_len, 0, setups[0].layout()))
    # Earlier tests of this process may have compiled the same programs already.
    step_programs, init_programs = (
        setups[0].train_step._cache_size(),
        setups[0].init.func._cache_size(),
    )
    trained = []
    for setup in setups:
        state, _ = setup.train_step(setup.init(), setup.global_batch(batch), setup.step_values)
        trained.append(np.asarray(jax.tree.leaves(state.params)[0]))
    assert setups[0].train_step._cache_size() <= step_programs + 1
    assert setups[0].init.func._cache_size() <= init_programs + 1
    for i, params in enumerate(trained[1:], start=1):
        assert not np.array_equal(params, trained[0]), f"run {i} trained as run 0 did"


def test_options_that_change_the_program_build_their_own(corpus):
    cfg = short_run_config(corpus)
    other_model = cfg.replace(model=cfg.model.replace(n_heads=1))
    other_optimizer = with_optim(cfg, clip_norm=0.0)
    assert program_config(cfg) != program_config(other_model)
    assert build(cfg).train_step is not build(other_model).train_step
    assert build(cfg).train_step is not build(other_optimizer).train_step


def test_resuming_with_a_longer_schedule_takes_its_values(tmp_path, corpus):
    cfg = short_run_config(corpus, checkpoint_every=2, steps=4)
    train(cfg, str(tmp_path))
    longer = cfg.replace(steps=12)
    train(longer, str(tmp_path), stop_after=6)
    records = {r["step"]: r for r in read_metrics(str(tmp_path))}
    new_schedule = build(longer).step_values.schedule
    for step in (5, 6):
        assert records[step]["lr"] == pytest.approx(learning_rates(new_schedule, step - 1)["lr"])
    assert records[5]["lr"] > 2 * records[4]["lr"], "the longer schedule has not decayed yet"


def test_a_checkpoint_of_the_release_before_values_resumes(tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(RELEASE_RUN, workdir)
    shutil.rmtree(workdir / "checkpoints" / "4")
    cfg = TrainConfig.from_dict(json.loads((RELEASE_RUN / "config.json").read_text()))
    result = train(cfg, str(workdir))
    assert result.step == 4
    release = {r["step"]: r["loss"] for r in read_metrics(RELEASE_RUN)}
    resumed = {r["step"]: r["loss"] for r in read_metrics(str(workdir))}
    np.testing.assert_allclose([resumed[3], resumed[4]], [release[3], release[4]], rtol=1e-5)
    expected, got = load_params(RELEASE_RUN, 4), load_params(workdir, 4)
    for a, b in zip(jax.tree.leaves(expected.params), jax.tree.leaves(got.params), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
