"""Training data: passkey rows, packed text, shards, host layout, iterator state."""

import dataclasses
import json
import re
import sys

import numpy as np
import pytest

from bam_configs.training import DataConfig
from bam_jax import passkey
from bam_jax.io import documents
from bam_jax.io import shards as shard_readers
from bam_jax.tokenizers import get_tokenizer
from bam_train import shards
from bam_train.data import (
    BatchLayout,
    PasskeyRows,
    build_rows,
    local_batches,
    loss_positions_per_row,
    train_iterator,
    val_batches,
)

SEQ = 128


@pytest.fixture(scope="module")
def mistral():
    return get_tokenizer("mistral")


@pytest.fixture
def text_file(tmp_path):
    docs = ["first document here.", "a second, longer document with more words in it.", "3rd"]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs * 20))
    return str(path), docs


def test_passkey_row_trains_only_the_answer_digits(mistral):
    rows = PasskeyRows(DataConfig(), mistral, SEQ, seed=0)
    for index in range(5):
        row = rows[index]
        text = mistral.decode(row["inputs"][row["segment_ids"] >= 0].tolist())
        assert text.startswith(passkey.TASK) and passkey.QUESTION in text
        key = text.split("The pass key is ")[1].split(".")[0]
        answer = mistral.decode(row["targets"][row["loss_mask"] > 0].tolist())
        assert row["loss_mask"].sum() == passkey.PREDICTED_DIGITS
        assert answer == key[-passkey.PREDICTED_DIGITS :]


def test_passkey_rows_vary_and_are_deterministic(mistral):
    cfg = DataConfig()
    rows_a, rows_b = PasskeyRows(cfg, mistral, SEQ, seed=3), PasskeyRows(cfg, mistral, SEQ, seed=3)
    np.testing.assert_array_equal(rows_a[7]["inputs"], rows_b[7]["inputs"])
    lengths, needle_starts, fillers = set(), set(), set()
    needle_ids = mistral.encode("The pass key is")
    for index in range(40):
        row = rows_a[index]
        tokens = row["inputs"][row["segment_ids"] >= 0].tolist()
        lengths.add(len(tokens))
        starts = [i for i in range(len(tokens)) if tokens[i : i + len(needle_ids)] == needle_ids]
        needle_starts.add(starts[0])
        fillers.add(mistral.decode(tokens[: starts[0]]))
    assert len(lengths) > 10 and len(needle_starts) > 3 and len(fillers) > 10


def test_passkey_rows_without_the_task_sentence(mistral):
    rows = PasskeyRows(DataConfig(passkey_task_fraction=0.5), mistral, SEQ, seed=0)
    with_task, needle_first, lengths = 0, 0, []
    for index in range(60):
        row = rows[index]
        text = mistral.decode(row["inputs"][row["segment_ids"] >= 0].tolist())
        key = text.split("The pass key is ")[1].split(".")[0]
        answer = mistral.decode(row["targets"][row["loss_positions"]].tolist())
        assert answer == key[-passkey.PREDICTED_DIGITS :] and passkey.QUESTION in text
        with_task += text.startswith(passkey.TASK)
        needle_first += text.startswith("The pass key is")
        lengths.append(int((row["segment_ids"] >= 0).sum()))
    assert 15 <= with_task <= 45 and needle_first > 0
    task_length = len(mistral.encode(passkey.TASK))
    shortest_with_task = passkey.passkey_template(mistral).min_length
    assert min(lengths) < shortest_with_task - task_length // 2 and max(lengths) <= SEQ
    # passkey_min_length still bounds the target length when the task is left out.
    floor = DataConfig(passkey_task_fraction=0.5, passkey_min_length=shortest_with_task)
    rows = PasskeyRows(floor, mistral, SEQ, seed=0)
    floored = [int((rows[i]["segment_ids"] >= 0).sum()) for i in range(60)]
    assert min(floored) > shortest_with_task - task_length // 2


def test_passkey_rows_with_language_model_positions(mistral):
    cfg = DataConfig(passkey_lm_positions=12)
    assert loss_positions_per_row(cfg) == passkey.PREDICTED_DIGITS + 12
    plain = PasskeyRows(DataConfig(), mistral, SEQ, seed=0)
    rows = PasskeyRows(cfg, mistral, SEQ, seed=0)
    for index in range(10):
        row = rows[index]
        np.testing.assert_array_equal(row["inputs"], plain[index]["inputs"])
        answer = plain[index]["loss_positions"]
        lm, tail = row["loss_positions"][:12], row["loss_positions"][12:]
        np.testing.assert_array_equal(tail, answer)
        assert len(set(lm.tolist())) == 12 and lm.min() >= 0 and lm.max() < answer[0] - 1
        assert row["loss_mask"].sum() == 12 + passkey.PREDICTED_DIGITS
    with pytest.raises(ValueError, match=r"data\.passkey_lm_positions \(200\)"):
        PasskeyRows(DataConfig(passkey_lm_positions=200), mistral, SEQ, seed=0)


def test_passkey_rows_with_multikey_prompts(mistral):
    cfg = DataConfig(passkey_multikey_fraction=0.5, passkey_task_fraction=0.5)
    rows = PasskeyRows(cfg, mistral, SEQ, seed=0)
    multikey = 0
    for index in range(40):
        row = rows[index]
        n = int((row["segment_ids"] >= 0).sum())
        text = mistral.decode(row["inputs"][:n].tolist())
        asked = re.search(r"What is the (\w+) pass key\?", text)
        answer = mistral.decode(row["targets"][row["loss_positions"]].tolist())
        multikey += asked is not None
        if asked is not None:
            asked = asked.group(1)
            assert text.count(" pass key is ") == 2 + 1  # two needles and the question
            key = text.split(f"The {asked} pass key is ", 1)[1].split(".")[0]
            assert key.endswith(answer)
        assert len(answer) == passkey.PREDICTED_DIGITS
    assert 10 < multikey < 30
    with pytest.raises(ValueError, match=r"data\.passkey_multikey_needles: 6 needles"):
        PasskeyRows(
            DataConfig(passkey_multikey_fraction=0.5, passkey_multikey_needles=6),
            mistral,
            SEQ,
            seed=0,
        )


def test_passkey_all_tokens_loss(mistral):
    row = PasskeyRows(DataConfig(passkey_loss="all"), mistral, SEQ, seed=0)[0]
    np.testing.assert_array_equal(row["loss_mask"] > 0, row["segment_ids"] >= 0)


def test_passkey_context_too_short_is_an_error(mistral):
    with pytest.raises(ValueError, match="max_seq_len"):
        PasskeyRows(DataConfig(), mistral, 40, seed=0)


def test_text_rows_pack_documents_with_ids_and_positions(text_file):
    path, docs = text_file
    cfg = DataConfig(source="text", path=path, tokenizer="byte", val_rows=0, shuffle=False)
    rows = build_rows(cfg, 32, seed=0, split="train")
    stream = np.concatenate([[1, *get_tokenizer("byte").encode(d), 2] for d in docs * 20])
    row = rows[1]
    np.testing.assert_array_equal(row["inputs"], stream[32:64])
    np.testing.assert_array_equal(row["targets"], stream[33:65])
    for t in range(1, 32):
        new_doc = row["inputs"][t] == 1
        assert (row["segment_ids"][t] == row["segment_ids"][t - 1] + 1) == new_doc
        assert (row["positions"][t] == 0) == new_doc
        assert row["loss_mask"][t - 1] == (0.0 if new_doc else 1.0)


def test_validation_is_a_held_out_prefix(text_file):
    path, _ = text_file
    cfg = DataConfig(source="text", path=path, tokenizer="byte", val_rows=4)
    val = build_rows(cfg, 32, seed=0, split="val")
    train_rows = build_rows(dataclasses.replace(cfg, shuffle=False), 32, 0, "train")
    assert len(val) == 4
    first_train = build_rows(dataclasses.replace(cfg, val_rows=0, shuffle=False), 32, 0, "train")
    np.testing.assert_array_equal(val[0]["inputs"], first_train[0]["inputs"])
    np.testing.assert_array_equal(train_rows[0]["inputs"], first_train[4]["inputs"])


def test_training_starts_a_gap_of_tokens_after_the_validation_rows(text_file):
    path, docs = text_file
    cfg = DataConfig(
        source="text", path=path, tokenizer="byte", val_rows=4, val_gap_tokens=7, shuffle=False
    )
    stream = np.concatenate([[1, *get_tokenizer("byte").encode(d), 2] for d in docs * 20])
    train_rows = build_rows(cfg, 32, 0, "train")
    first = 4 * 32 + 7
    for k in (0, 3):
        start = first + 32 * k
        np.testing.assert_array_equal(train_rows[k]["inputs"], stream[start : start + 32])
        np.testing.assert_array_equal(train_rows[k]["targets"], stream[start + 1 : start + 33])
    assert len(build_rows(cfg, 32, 0, "val")) == 4


def test_a_gap_spans_shards_in_order(text_file, tmp_path):
    path, _ = text_file
    out = str(tmp_path / "shards")
    shards.write_shards(
        documents.iter_dataset_texts(path), out, get_tokenizer("byte"), shard_tokens=300
    )
    sizes = [len(tokens) for tokens, _ in shard_readers.open_shards(out)]
    text_cfg = DataConfig(source="text", path=path, tokenizer="byte", val_rows=0, shuffle=False)
    shard_cfg = dataclasses.replace(
        text_cfg, source="shards", path=out, val_gap_tokens=sizes[0] + 5
    )
    rows = build_rows(shard_cfg, 16, 0, "train")
    stream = np.concatenate([tokens for tokens, _ in shard_readers.open_shards(out)])
    np.testing.assert_array_equal(rows[0]["inputs"], stream[sizes[0] + 5 : sizes[0] + 21])


def test_boundary_targets_train_the_step_into_the_next_document(text_file):
    path, _ = text_file
    cfg = DataConfig(source="text", path=path, tokenizer="byte", val_rows=0, shuffle=False)
    masked = build_rows(cfg, 32, 0, "train")[0]
    trained = build_rows(dataclasses.replace(cfg, boundary_targets=True), 32, 0, "train")[0]
    assert masked["loss_mask"].min() == 0.0
    np.testing.assert_array_equal(trained["loss_mask"], np.ones(32, np.float32))
    np.testing.assert_array_equal(trained["targets"], masked["targets"])


def test_shards_match_text_rows(text_file, tmp_path):
    path, _ = text_file
    out = str(tmp_path / "shards")
    texts = documents.iter_dataset_texts(path)
    meta = shards.write_shards(texts, out, get_tokenizer("byte"), shard_tokens=300)
    assert len(meta["shards"]) > 2 and meta["vocab_size"] == 259
    text_cfg = DataConfig(source="text", path=path, tokenizer="byte", val_rows=0, shuffle=False)
    shard_cfg = dataclasses.replace(text_cfg, source="shards", path=out)
    text_rows = build_rows(text_cfg, 16, 0, "train")
    shard_rows = build_rows(shard_cfg, 16, 0, "train")
    for key in ("inputs", "targets", "segment_ids", "loss_mask"):
        np.testing.assert_array_equal(shard_rows[0][key], text_rows[0][key])


def test_shards_from_a_saved_hugging_face_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    saved = str(tmp_path / "saved")
    datasets.Dataset.from_dict({"text": ["hello world", "bam attention"]}).save_to_disk(saved)
    out = str(tmp_path / "shards")
    shards.main(["--dataset", saved, "--out", out, "--tokenizer", "byte"])
    tokens, starts = shard_readers.open_shards(out)[0]
    byte = get_tokenizer("byte")
    assert starts.tolist() == [0, 13]
    assert byte.decode(tokens[starts[1] + 1 : -1].tolist()) == "bam attention"


def test_training_reads_a_saved_dataset_as_it_reads_the_same_jsonl(tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = [f"document {i}: " + "bam attention " * (i + 3) for i in range(40)]
    saved = str(tmp_path / "saved")
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(saved)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    config = DataConfig(source="text", tokenizer="byte", text_key="body", val_rows=2)
    from_dataset = build_rows(dataclasses.replace(config, path=saved), 32, 0, "val")
    from_jsonl = build_rows(dataclasses.replace(config, path=str(jsonl)), 32, 0, "val")
    assert len(from_dataset) == len(from_jsonl) == 2
    for a, b in zip(from_dataset, from_jsonl, strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])


def test_a_dataset_field_that_is_missing_names_the_record(tmp_path):
    datasets = pytest.importorskip("datasets")
    saved = str(tmp_path / "saved")
    datasets.Dataset.from_dict({"content": ["a", "b"]}).save_to_disk(saved)
    with pytest.raises(ValueError, match=r"saved record 0: no field 'text'.*\['content'\]"):
        list(documents.source_documents(saved))


def test_hub_dataset_offline_is_a_clear_error(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError, match="could not stream 'HuggingFaceFW/fineweb'"):
        next(documents.iter_dataset_texts("HuggingFaceFW/fineweb", subset="sample-10BT"))


def test_processes_read_disjoint_parts_of_the_global_batch():
    rows = _IndexRows()
    whole = local_batches(rows, BatchLayout(accum_steps=2, batch_size=4))
    halves = [
        local_batches(rows, BatchLayout(2, 4, row_start=start, row_count=2)) for start in (0, 2)
    ]
    for step in range(3):
        joined = np.concatenate([h[step]["index"] for h in halves], axis=1)
        np.testing.assert_array_equal(joined, whole[step]["index"])
        np.testing.assert_array_equal(whole[step]["index"].ravel(), np.arange(8) + 8 * step)


def test_iterator_state_resumes_the_same_batches(mistral):
    cfg = DataConfig(num_threads=2)
    layout = BatchLayout(1, 2)
    it = train_iterator(cfg, SEQ, 0, layout)
    next(it)
    state = it.get_state()
    expected = next(it)["inputs"]
    resumed = train_iterator(cfg, SEQ, 0, layout)
    resumed.set_state(state)
    np.testing.assert_array_equal(next(resumed)["inputs"], expected)


def test_passkey_validation_differs_from_training():
    layout = BatchLayout(1, 2)
    val = val_batches(DataConfig(), SEQ, 0, layout, 1)[0]
    train = next(train_iterator(DataConfig(), SEQ, 0, layout))
    assert not np.array_equal(val["inputs"], train["inputs"])


class _IndexRows:
    def __len__(self):
        return sys.maxsize

    def __getitem__(self, index):
        return {"index": np.asarray(index)}


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("source", "parquet", "data.source"),
        ("passkey_loss", "digits", "data.passkey_loss"),
        ("val_rows", -1, "data.val_rows"),
        ("passkey_task_fraction", 1.5, r"data.passkey_task_fraction must be in \[0, 1\]"),
        ("passkey_lm_positions", -1, "data.passkey_lm_positions must be >= 0"),
    ],
)
def test_bad_data_config_is_a_value_error(field, value, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**{field: value})
