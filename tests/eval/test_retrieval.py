"""RULER-style retrieval prompts (bam_jax.retrieval): structure, answers and limits."""

from __future__ import annotations

import re

import numpy as np
import pytest

from bam_eval.passkey import PasskeySettings
from bam_jax.passkey import FILLER_NOUNS, PREDICTED_DIGITS, build_passkey_samples
from bam_jax.retrieval import (
    RetrievalTask,
    build_task_samples,
    check_target_length,
    task_min_length,
    task_token_budget,
)
from bam_jax.tokenizers import get_tokenizer

TOKENIZER = get_tokenizer("passkey:mistral")


def samples(name: str, needles: int = 4, length: int = 600, n: int = 5, seed: int = 0):
    task = RetrievalTask(name, needles)
    rng = np.random.default_rng(seed)
    return task, build_task_samples(TOKENIZER, task, length, n, rng=rng)


def text(tokens) -> str:
    return TOKENIZER.decode([int(t) for t in tokens])


def digits_of(sample) -> str:
    return text(sample.tokens[sample.answer_positions])


@pytest.mark.parametrize("name", ["multikey", "multivalue", "vartrack"])
def test_prompts_fit_the_length_and_answers_are_the_asked_keys(name: str) -> None:
    task, built = samples(name)
    for sample in built:
        assert sample.prompt_length <= sample.target_length
        assert len(sample.tokens) <= task_token_budget(TOKENIZER, task, sample.target_length)
        assert len(sample.answer_positions) == PREDICTED_DIGITS * task.answer_values
        assert str(sample.key)[-PREDICTED_DIGITS:] in digits_of(sample)
        placed = text(
            sample.tokens[sample.needle_start : sample.needle_start + sample.needle_length]
        )
        assert str(sample.key) in placed
    # Equidistant depths: the placed needle moves from the start to the end of the filler.
    assert built[0].filler_before == 0 and built[-1].filler_after == 0


def test_multikey_asks_for_one_of_several_distinct_keys() -> None:
    _, built = samples("multikey", needles=5)
    for sample in built:
        prompt = text(sample.tokens[: sample.prompt_length])
        nouns = [n for n in FILLER_NOUNS if f"The {n} pass key is" in prompt]
        assert len(nouns) == 5
        asked = prompt.rsplit("What is the ", 1)[1].split(" pass key?")[0]
        assert f"The {asked} pass key is {sample.key}." in prompt
        keys = {int(w.rstrip(".")) for w in prompt.split() if w.rstrip(".").isdigit()}
        assert len(keys) == 5


def test_multivalue_answers_every_value_in_order() -> None:
    _, built = samples("multivalue", needles=3)
    for sample in built:
        prompt = text(sample.tokens[: sample.prompt_length])
        noun = prompt.rsplit("What is the ", 1)[1].split(" pass key?")[0]
        values = [part.split(".")[0] for part in prompt.split(f"The {noun} pass key is ")[1:]]
        expected = "".join(v[-PREDICTED_DIGITS:] for v in values)
        assert len(values) == 3 and digits_of(sample) == expected


def test_vartrack_chain_runs_in_order_to_the_asked_noun() -> None:
    _, built = samples("vartrack", needles=4)
    for sample in built:
        prompt = text(sample.tokens[: sample.prompt_length])
        [first] = re.findall(rf"The (\w+) pass key is {sample.key}\. Remember", prompt)
        links = re.findall(r"The (\w+) pass key is the (\w+) pass key\.", prompt)
        first_link = prompt.index(f"The {links[0][0]} pass key is the")
        assert (
            len(links) == 3 and prompt.index(f"The {first} pass key is {sample.key}") < first_link
        )
        assert [old for _, old in links] == [first, *[new for new, _ in links[:-1]]]
        last = links[-1][0]
        assert prompt.endswith(f"What is the {last} pass key? The {last} pass key is")


def test_passkey_task_is_the_passkey_builder() -> None:
    task = RetrievalTask("passkey")
    got = build_task_samples(TOKENIZER, task, 500, 3, rng=np.random.default_rng(4))
    want = build_passkey_samples(TOKENIZER, 500, 3, rng=np.random.default_rng(4))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.tokens, w.tokens)


def test_settings_keys_and_errors() -> None:
    passkey = PasskeySettings().as_dict()
    assert "task" not in passkey and "needles" not in passkey  # results stored before match
    assert PasskeySettings(task="vartrack", needles=3).as_dict()["task"] == "vartrack"
    with pytest.raises(ValueError, match="task must be one of"):
        RetrievalTask("niah")
    with pytest.raises(ValueError, match="needles must be in"):
        RetrievalTask("multikey", 1)
    minimum = task_min_length(TOKENIZER, RetrievalTask("multikey", 4))
    check_target_length(TOKENIZER, RetrievalTask("multikey", 4), minimum)
    with pytest.raises(ValueError, match="below the multikey prompt's minimum"):
        check_target_length(TOKENIZER, RetrievalTask("multikey", 4), minimum - 1)


def test_same_seed_same_samples() -> None:
    a = samples("multikey", seed=7)[1]
    b = samples("multikey", seed=7)[1]
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.tokens, y.tokens)
