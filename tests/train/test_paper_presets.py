"""The paper presets against the table of the authors' values in docs/spec.md section 9."""

import ast
import functools
import math
import re

import pytest

from bam_configs.presets import PAPER_CONTEXTS, PAPER_SIZES, preset
from tests.support import REPO_ROOT

SPEC = REPO_ROOT / "docs" / "spec.md"
ROW = re.compile(r"^\| `(?P<field>[^`]+)` \| (?P<authors>[^|]+) \| `(?P<value>[^`]+)` \|$")
# Fields the table must cover: what a preset would get wrong without them.
REQUIRED_FIELDS = {
    "model.prior_alpha_init",
    "model.prior_beta_init",
    "model.prior_mu_init",
    "model.train_prior_mu",
    "model.global_prior",
    "optim.lr",
    "optim.prior_lr",
    "optim.ssmax_lr",
    "optim.numerics",
    "data.shuffle",
    "data.val_gap_tokens",
    "data.val_rows * model.max_seq_len",
    "data.boundary_targets",
}
PAPER_PRESETS = [f"{size}_{context}" for size in PAPER_SIZES for context in PAPER_CONTEXTS]


@functools.cache
def authors_table() -> dict[str, object]:
    """field -> preset value, from the table of docs/spec.md section 9."""
    section = SPEC.read_text().split("## 9.")[1].split("\n## ")[0]
    rows = [ROW.match(line) for line in section.splitlines()]
    return {row["field"]: ast.literal_eval(row["value"]) for row in rows if row}


def field_value(cfg, field: str):
    factors = [functools.reduce(getattr, name.split("."), cfg) for name in field.split(" * ")]
    return math.prod(factors) if len(factors) > 1 else factors[0]


def test_the_table_covers_the_fields_that_decide_where_a_run_starts():
    assert set(authors_table()) >= REQUIRED_FIELDS


@pytest.mark.parametrize("name", PAPER_PRESETS)
def test_paper_preset_has_the_authors_values(name):
    cfg = preset(name)
    wrong = {
        field: (field_value(cfg, field), value)
        for field, value in authors_table().items()
        if field_value(cfg, field) != value
    }
    assert not wrong, f"{name}: field: (preset, authors') {wrong}"


@pytest.mark.parametrize("name", PAPER_PRESETS)
def test_paper_preset_validates_on_whole_micro_batches(name):
    cfg = preset(name)
    rows = cfg.batch_size * cfg.eval_batches
    assert rows == cfg.data.val_rows
    assert cfg.batch_size * cfg.model.max_seq_len == 32_768


# The language-model presets keep every optimizer and prior value of the authors' recipe but
# their size-dependent ones: one learning rate for every group, stated in their docstring.
LM_PRESETS = ("paper_lm", "paper_lm_copy")
LM_DEPARTURES = {"optim.lr", "optim.prior_lr", "optim.ssmax_lr", "model.dtype"}


@pytest.mark.parametrize("name", LM_PRESETS)
def test_language_model_presets_keep_the_authors_optimizer_and_prior(name):
    cfg = preset(name)
    pinned = {
        field: value
        for field, value in authors_table().items()
        if field.startswith(("optim.", "model.")) and field not in LM_DEPARTURES
    }
    assert {"optim.numerics", "optim.warmup_steps", "model.prior_beta_init"} <= set(pinned)
    wrong = {f: (field_value(cfg, f), v) for f, v in pinned.items() if field_value(cfg, f) != v}
    assert not wrong, f"{name}: field: (preset, authors') {wrong}"
    assert cfg.optim.lr == cfg.optim.prior_lr == cfg.optim.ssmax_lr
    assert (cfg.data.source, cfg.data.tokenizer, cfg.data.shuffle) == ("text", "byte", False)
    assert cfg.model.local_layers == 0 and cfg.ssmax_jitter == 0 and cfg.prior_dilation == 1


def test_only_copy_seeding_tells_the_language_model_presets_apart():
    pure, seeded = preset("paper_lm"), preset("paper_lm_copy")
    assert pure.data.copy_seeding == 0 and 0 < seeded.data.copy_seeding < 1
    assert seeded.replace(data=pure.data) == pure
