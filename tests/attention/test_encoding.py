"""The encoding name is read in one place (bam_jax.config.Encoding); everything else asks it."""

from __future__ import annotations

import re

import pytest

from bam_jax import ENCODINGS, Encoding, ModelConfig
from tests.support import REPO_ROOT

ROOT = REPO_ROOT
SOURCE_FOLDERS = ("bam_jax", "train", "eval", "configs", "quickstart", "bench")
# What reading an encoding's name by hand looks like (a kernel's `prior_kind` "alibi" is
# another vocabulary).
NAME_PARSING = re.compile(
    r"""(endswith|removesuffix|startswith)\("_ssmax"\)|"_ssmax"|"""
    r"""[=!]= "(bam|alibi|nope|rope|rope_local|sinusoidal)(_ssmax)?"|"""
    r"""in \("(bam|alibi|nope|rope|sinusoidal)\""""
)


@pytest.mark.parametrize(
    "name, family, ssmax, learned, additive, rotary",
    [
        ("bam_ssmax", "bam", True, True, True, False),
        ("bam", "bam", False, True, True, False),
        ("alibi_ssmax", "alibi", True, False, True, False),
        ("rope", "rope", False, False, False, True),
        ("rope_local", "rope_local", False, False, False, True),
        ("nope_ssmax", "nope", True, False, False, False),
        ("sinusoidal", "sinusoidal", False, False, False, False),
    ],
)
def test_an_encoding_name_splits_into_its_fields(name, family, ssmax, learned, additive, rotary):
    encoding = Encoding.parse(name)
    assert (encoding.family, encoding.ssmax) == (family, ssmax)
    assert (encoding.learned_prior, encoding.additive_prior, encoding.rotary) == (
        learned,
        additive,
        rotary,
    )
    assert encoding.name == name


def test_every_encoding_round_trips_and_only_one_family_flag_is_set():
    for name in ENCODINGS:
        encoding = Encoding.parse(name)
        assert encoding.name == name
        flags = (encoding.learned_prior, encoding.alibi, encoding.rotary, encoding.absolute)
        assert sum(flags) + encoding.positionless == 1, name


def test_an_unknown_encoding_names_the_field_and_the_choices():
    with pytest.raises(ValueError, match=r"--encodings must be one of \('nope'.*got 'bam_rope'"):
        Encoding.parse("bam_rope", field="--encodings")
    with pytest.raises(ValueError, match="encoding must be one of"):
        ModelConfig(encoding="rope_local_ssmax")


def test_the_prior_layout_follows_the_encoding_and_global_prior():
    per_layer = ModelConfig(encoding="bam", global_prior=False)
    assert per_layer.per_layer_prior and not per_layer.shared_prior
    assert ModelConfig(encoding="bam_ssmax").shared_prior
    alibi = ModelConfig(encoding="alibi", global_prior=False)
    assert not (alibi.per_layer_prior or alibi.shared_prior)


def test_no_module_outside_the_config_parses_encoding_names():
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for folder in SOURCE_FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != ROOT / "bam_jax" / "config.py"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if NAME_PARSING.search(line) and "kind" not in line
    ]
    assert not offenders, "parse the name with bam_jax.Encoding:\n" + "\n".join(offenders)
