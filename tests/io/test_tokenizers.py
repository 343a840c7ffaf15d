"""Tokenisers: offline Mistral v0.3, bytes, files by path, errors."""

import importlib.util

import pytest

from bam_configs.training import DataConfig
from bam_jax.passkey import build_passkey_sample
from bam_jax.tokenizers import (
    ByteTokenizer,
    PasskeyVocabulary,
    get_tokenizer,
    mistral_model_path,
)
from bam_train.data import PasskeyRows

TEXT = "The pass key is 12345. Remember it. Ünïcode too."


def test_mistral_is_offline_v3_vocabulary():
    tok = get_tokenizer("mistral")
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (32768, 1, 2)
    ids = tok.encode(TEXT)
    assert tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode(ids) == TEXT


def test_model_file_by_path_matches_mistral():
    by_path = get_tokenizer(mistral_model_path())
    assert by_path.encode(TEXT) == get_tokenizer("mistral").encode(TEXT)


def test_byte_tokenizer_round_trip():
    tok = get_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    ids = tok.encode(TEXT)
    assert min(ids) >= 3 and max(ids) < tok.vocab_size == 259
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == TEXT


@pytest.mark.parametrize("spec", ["gpt9", "/nonexistent/tok.model", "/nonexistent/tokenizer.json"])
def test_unknown_tokenizer_is_a_value_error(spec):
    with pytest.raises(ValueError, match="tokenizer"):
        get_tokenizer(spec)


def save_word_level_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 4}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(path)


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="needs tokenizers")
def test_tokenizer_json_by_path(tmp_path):
    path = str(tmp_path / "tokenizer.json")
    save_word_level_tokenizer(path)
    tok = get_tokenizer(path)
    assert tok.encode("hello world") == [3, 4]
    assert (tok.bos_id, tok.eos_id) == (0, 1)


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="needs tokenizers")
def test_tokenizer_by_directory_and_by_cached_model_name(tmp_path, monkeypatch):
    import huggingface_hub

    save_word_level_tokenizer(str(tmp_path / "tokenizer.json"))
    assert get_tokenizer(str(tmp_path)).encode("hello world") == [3, 4]
    asked = []

    def from_cache(repo_id, filename, *, local_files_only):
        asked.append((repo_id, filename, local_files_only))
        return str(tmp_path / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", from_cache)
    assert get_tokenizer("hf:org/model").encode("world hello") == [4, 3]
    assert asked == [("org/model", "tokenizer.json", True)]


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="needs tokenizers")
def test_a_model_name_missing_from_the_cache_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=r"'hf:org/absent' has no tokenizer.json in the local"):
        get_tokenizer("hf:org/absent")


def test_passkey_vocabulary_renumbers_the_passkey_tokens_of_its_base():
    base, tok = get_tokenizer("mistral"), get_tokenizer("passkey:mistral")
    assert tok.name == "passkey:mistral" and (tok.bos_id, tok.eos_id) == (0, 1)
    assert 10 < tok.vocab_size < 128
    sample = build_passkey_sample(tok, 600, key=908172, depth=0.3)
    reference = build_passkey_sample(base, 600, key=908172, depth=0.3)
    assert [tok.base_ids[i] for i in sample.tokens] == reference.tokens.tolist()
    assert tok.decode(sample.tokens.tolist()) == base.decode(reference.tokens.tolist())
    assert sample.tokens.max() < tok.vocab_size


def test_passkey_vocabulary_covers_every_training_prompt():
    tok = get_tokenizer("passkey:mistral")
    rows = PasskeyRows(DataConfig(tokenizer=tok.name, passkey_task_fraction=0.5), tok, 160, 3)
    assert max(int(rows[i]["inputs"].max()) for i in range(500)) < tok.vocab_size


def test_passkey_vocabulary_decodes_padding_ids_as_replacement_characters():
    tok = get_tokenizer("passkey:mistral")
    digits = tok.encode(" 42")
    assert tok.decode([*digits, tok.vocab_size, *digits[-1:], 127]) == " 42\ufffd2\ufffd"


def test_passkey_vocabulary_refuses_other_text():
    with pytest.raises(ValueError, match=r"passkey:mistral.*only knows"):
        get_tokenizer("passkey:mistral").encode("Quantum chromodynamics")


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="needs tokenizers")
def test_tokenizer_json_vocabulary_covers_ids_past_a_gap(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 40}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    path = str(tmp_path / "tokenizer.json")
    hf.save(path)
    tok = get_tokenizer(path)
    assert tok.encode("hello world") == [3, 40] and tok.vocab_size == 41
    assert tok.decode([3, 41]) == "hello\ufffd"


@pytest.mark.parametrize("spec", ["byte", "mistral"])
def test_ids_past_the_vocabulary_decode_as_replacement_characters(spec):
    tok = get_tokenizer(spec)
    ids = tok.encode("ab")
    assert tok.decode([*ids, tok.vocab_size, -1, *ids]) == "ab\ufffd\ufffdab"


def test_passkey_vocabulary_needs_a_base_with_bos_and_eos():
    class NoEosBytes(ByteTokenizer):
        name = "no-eos-bytes"

        @property
        def eos_id(self) -> int:
            return -1

    with pytest.raises(ValueError, match=r"tokenizer 'no-eos-bytes' has no EOS token \(eos_id -1"):
        PasskeyVocabulary(NoEosBytes())
