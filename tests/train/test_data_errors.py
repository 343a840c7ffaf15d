"""Data that would break a run is refused where it enters, naming the file and line (or
position) and what was expected: .jsonl/.txt records, shard files and token ids."""

import dataclasses
import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bam_configs.presets import preset
from bam_configs.training import DataConfig
from bam_jax.io import shards as shard_readers
from bam_jax.io.documents import Document, iter_documents, located_documents
from bam_jax.tokenizers import ByteTokenizer, get_tokenizer
from bam_train import loop, shards
from bam_train.data import build_rows, tokenize_documents

GOOD = json.dumps({"text": "a good line"})


class NoBosBytes(ByteTokenizer):
    """Bytes without a BOS token, as a tokenizer.json without <s> reports it."""

    name = "no-bos-bytes"

    @property
    def bos_id(self) -> int:
        return -1


class TooSmallBytes(ByteTokenizer):
    """Bytes that claim a vocabulary of 100: letters encode past it."""

    name = "too-small-bytes"

    @property
    def vocab_size(self) -> int:
        return 100


def write_lines(path, lines: list[bytes]) -> str:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return str(path)


# ----------------------------------------------------------------------------- text files


@pytest.mark.parametrize(
    ("bad_line", "expected"),
    [
        (
            b'{"text": "unterminated',
            r"line 2: not valid JSON at column 10 \(Unterminated string starting\)",
        ),
        (
            b'["text", "a list"]',
            r"line 2: expected a JSON object with a 'text' field, got an array",
        ),
        (b"42", r"line 2: expected a JSON object with a 'text' field, got a number"),
        (b'{"body": "x"}', r"line 2: no field 'text' \(fields: \['body'\]\); set data.text_key"),
        (b'{"text": 7}', r"line 2: field 'text' is a number, expected a string"),
        (b'{"text": null}', r"line 2: field 'text' is null, expected a string"),
        (b'{"text": ["a"]}', r"line 2: field 'text' is an array, expected a string"),
        (b'{"text": "caf\xe9"}', r"line 2: not UTF-8 \(byte 0xe9 at column 14\)"),
    ],
)
def test_bad_jsonl_record_names_file_and_line(tmp_path, bad_line, expected):
    path = write_lines(tmp_path / "docs.jsonl", [GOOD.encode(), bad_line, GOOD.encode()])
    with pytest.raises(ValueError, match=f"^{path} {expected}"):
        list(iter_documents([path]))


def test_non_utf8_txt_names_the_line_of_the_bad_byte(tmp_path):
    path = write_lines(tmp_path / "doc.txt", [b"first line", b"second", b"third \xff line"])
    with pytest.raises(ValueError, match=rf"^{path} line 3: not UTF-8 \(byte 0xff at column 7\)"):
        list(iter_documents([path]))


def test_a_byte_order_mark_is_not_part_of_the_text(tmp_path):
    jsonl = write_lines(tmp_path / "bom.jsonl", [b"\xef\xbb\xbf" + GOOD.encode()])
    txt = write_lines(tmp_path / "bom.txt", [b"\xef\xbb\xbfplain"])
    assert list(iter_documents([jsonl, txt])) == ["a good line", "plain\n"]


def test_documents_carry_their_file_and_line(tmp_path):
    path = write_lines(tmp_path / "docs.jsonl", [GOOD.encode(), b"", GOOD.encode()])
    wheres = [doc.where for doc in located_documents([path])]
    assert wheres == [f"{path} line 1", f"{path} line 3"]


def test_training_rows_from_a_bad_jsonl_name_file_and_line(tmp_path):
    path = write_lines(tmp_path / "docs.jsonl", [GOOD.encode()] * 50 + [b"[1, 2]"])
    cfg = DataConfig(source="text", path=path, tokenizer="byte", val_rows=0)
    with pytest.raises(ValueError, match=rf"^{path} line 51: expected a JSON object"):
        build_rows(cfg, 16, seed=0, split="train")


# ----------------------------------------------------------------------------- token ids of text


def test_missing_bos_token_names_the_tokenizer_and_the_option():
    docs = [Document("doc.txt", "hello")]
    with pytest.raises(ValueError, match=r"'no-bos-bytes' has no BOS token .*data.add_bos=False"):
        tokenize_documents(docs, NoBosBytes())
    tokens, _ = tokenize_documents(docs, NoBosBytes(), add_bos=False)
    assert tokens.min() >= 0


def test_ids_outside_the_tokenizer_vocabulary_name_file_line_and_id(tmp_path):
    path = write_lines(tmp_path / "docs.jsonl", [b'{"text": "AB"}', b'{"text": "Az"}'])
    expected = (
        rf"^{path} line 2: tokenizer 'too-small-bytes' encoded the text to id 125 \(token 1\)"
    )
    with pytest.raises(ValueError, match=expected):
        tokenize_documents(located_documents([path]), TooSmallBytes())


# ----------------------------------------------------------------------------- shards


@pytest.fixture
def shard_dir(tmp_path) -> str:
    out = str(tmp_path / "shards")
    texts = [f"document number {i} with some words." for i in range(40)]
    shards.write_shards(texts, out, get_tokenizer("byte"), shard_tokens=400)
    return out


def edit_meta(shard_dir: str, change) -> None:
    meta_path = os.path.join(shard_dir, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    change(meta)
    with open(meta_path, "w") as f:
        json.dump(meta, f)


def without_id_range(meta: dict) -> None:
    for shard in meta["shards"]:
        del shard["min_id"], shard["max_id"]


def put_token(shard_dir: str, name: str, position: int, value: int) -> str:
    file = os.path.join(shard_dir, name + ".tokens.npy")
    tokens = np.load(file)
    tokens[position] = value
    np.save(file, tokens)
    return file


def test_write_shards_records_the_id_range(shard_dir):
    meta = shard_readers.read_meta(shard_dir)
    for shard, (tokens, _) in zip(
        meta["shards"], shard_readers.open_shards(shard_dir), strict=True
    ):
        assert (shard["min_id"], shard["max_id"]) == (tokens.min(), tokens.max())


def test_recorded_id_range_past_the_vocabulary_names_file_id_and_position(shard_dir):
    edit_meta(shard_dir, lambda meta: meta.update(vocab_size=100))
    tokens = np.load(os.path.join(shard_dir, "shard-00000.tokens.npy"))
    position = int(np.flatnonzero(tokens >= 100)[0])
    expected = (
        rf"shard-00000.tokens.npy: token id {tokens[position]} at position {position}, "
        r"outside the vocabulary \[0, 100\)"
    )
    with pytest.raises(ValueError, match=expected):
        shard_readers.open_shards(shard_dir)


@pytest.mark.parametrize("bad_id", [300, -1])
def test_shards_without_an_id_range_are_scanned(shard_dir, bad_id):
    edit_meta(shard_dir, without_id_range)
    shard_readers.open_shards(shard_dir)
    file = put_token(shard_dir, "shard-00001", 7, bad_id)
    expected = rf"^{file}: token id {bad_id} at position 7, outside the vocabulary \[0, 259\)"
    with pytest.raises(ValueError, match=expected):
        shard_readers.open_shards(shard_dir)


@pytest.mark.parametrize("bad_id", [300, -1])
def test_a_shard_damaged_after_its_id_range_was_recorded_fails_when_read(shard_dir, bad_id):
    file = put_token(shard_dir, "shard-00000", 70, bad_id)
    cfg = DataConfig(source="shards", path=shard_dir, val_rows=4)
    rows = build_rows(cfg, 32, 0, "val")
    rows[0]
    expected = rf"^{file}: token id {bad_id} at position 70, outside the vocabulary \[0, 259\)"
    with pytest.raises(ValueError, match=expected):
        rows[2]


def test_shards_without_an_id_range_are_scanned_once(shard_dir):
    edit_meta(shard_dir, without_id_range)
    n_shards = len(shard_readers.read_meta(shard_dir)["shards"])
    before = shard_readers._id_range.cache_info().misses
    for _ in range(3):
        shard_readers.open_shards(shard_dir)
    assert shard_readers._id_range.cache_info().misses - before == n_shards


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda d: os.remove(f"{d}/shard-00001.starts.npy"), r"shard-00001.starts.npy is missing"),
        (
            lambda d: np.save(f"{d}/shard-00000.tokens.npy", np.zeros(3, np.int32)),
            r"shard-00000.tokens.npy: expected \d+ integers \(meta.json\), got a int32 array",
        ),
        (
            lambda d: np.save(f"{d}/shard-00000.starts.npy", np.asarray([0, 5, 2, 9])),
            r"shard-00000.starts.npy: expected \d+ integers",
        ),
        (
            lambda d: Path(d, "shard-00000.tokens.npy").write_bytes(b"not numpy"),
            r"shard-00000.tokens.npy: not a readable .npy array",
        ),
        (lambda d: edit_meta(d, lambda m: m.pop("vocab_size")), r"vocab_size must be a positive"),
        (lambda d: edit_meta(d, lambda m: m.update(shards=[{}])), r"shards must be a list of"),
        (
            lambda d: Path(d, "meta.json").write_text(Path(d, "meta.json").read_text() + "}"),
            r"meta.json: not valid JSON \(Extra data: line \d+",
        ),
    ],
)
def test_damaged_shard_directory_names_the_file(shard_dir, damage, expected):
    damage(shard_dir)
    with pytest.raises(ValueError, match=expected):
        shard_readers.open_shards(shard_dir)


def test_unordered_document_starts_name_the_file(shard_dir):
    file = os.path.join(shard_dir, "shard-00000.starts.npy")
    starts = np.load(file)
    np.save(file, starts[::-1].copy())
    with pytest.raises(ValueError, match=r"shard-00000.starts.npy: document starts must rise"):
        shard_readers.open_shards(shard_dir)


def test_write_shards_never_overwrites_existing_shards(shard_dir):
    before = {path.name: path.read_bytes() for path in Path(shard_dir).iterdir()}
    with pytest.raises(ValueError, match=r"already holds shards \(meta.json\)"):
        shards.write_shards(["other text"], shard_dir, get_tokenizer("byte"))
    assert {path.name: path.read_bytes() for path in Path(shard_dir).iterdir()} == before


@pytest.mark.parametrize(
    ("tokenizer", "expected"),
    [
        (NoBosBytes(), r"'no-bos-bytes' has no BOS token"),
        (TooSmallBytes(), r"document 0: tokenizer 'too-small-bytes' encoded the text to id"),
    ],
)
def test_write_shards_refuses_ids_outside_the_vocabulary(tmp_path, tokenizer, expected):
    with pytest.raises(ValueError, match=expected):
        shards.write_shards(["some text"], str(tmp_path / "out"), tokenizer)


def test_shards_command_prints_an_error_and_exits_2(tmp_path, capsys):
    path = write_lines(tmp_path / "docs.jsonl", [GOOD.encode(), b'{"text": 3}'])
    argv = ["--dataset", path, "--out", str(tmp_path / "out"), "--tokenizer", "byte"]
    with pytest.raises(SystemExit) as exit_info:
        shards.main(argv)
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr().err
        == f"error: {path} line 2: field 'text' is a number, expected a string\n"
    )


def test_training_on_a_bad_shard_fails_before_compiling(shard_dir, tmp_path, monkeypatch):
    edit_meta(shard_dir, without_id_range)
    file = put_token(shard_dir, "shard-00000", 3, 400)
    build = loop.build

    def build_without_compiling(cfg):
        def compiled(*args):
            raise AssertionError("compiled before the data was checked")

        return dataclasses.replace(build(cfg), init=compiled, train_step=compiled)

    monkeypatch.setattr(loop, "build", build_without_compiling)
    cfg = preset("micro")
    cfg = cfg.replace(
        model=cfg.model.replace(vocab_size=259, max_seq_len=16),
        data=DataConfig(source="shards", path=shard_dir, val_rows=2),
        batch_size=2,
    )
    with pytest.raises(ValueError, match=rf"^{file}: token id 400 at position 3"):
        loop.train(cfg, str(tmp_path / "run"))


# ----------------------------------------------------------------------------- the model


def test_model_embedding_reads_out_of_range_ids_as_documented():
    embed = nnx.Embed(5, 2, rngs=nnx.Rngs(0))
    rows = nnx.jit(lambda e, ids: e(ids))(embed, jnp.asarray([5, -6, -1]))
    assert np.isnan(rows[:2]).all()
    np.testing.assert_array_equal(rows[2], embed.embedding[...][4])
