"""The Python standard library as a text corpus: "python-stdlib" (training files) and
"python-stdlib:held-out" (whole modules kept for evaluation, clean by content), and the
`stdlib_bytes` preset."""

import os
import sysconfig

import pytest

from bam_configs.presets import preset
from bam_configs.training import validate_for_runtime
from bam_eval.perplexity import load_rows
from bam_jax.io.documents import (
    STDLIB,
    STDLIB_HELD_OUT,
    STDLIB_MAX_LINE_OVERLAP,
    held_out_source,
    source_documents,
    stdlib_files,
    stdlib_split,
)
from bam_jax.tokenizers import ByteTokenizer
from bam_quickstart.run import COMPARE_ENCODINGS, quickstart_config


@pytest.fixture
def fake_stdlib(tmp_path, monkeypatch):
    """A standard library folder of five .py files, two of them in folders left out."""
    root = tmp_path / "lib"
    for relative in ("a.py", "pkg/b.py", "pkg/c.txt", "test/d.py", "site-packages/e.py"):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(f"# {relative}\n")
    paths = sysconfig.get_paths()
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {**paths, "stdlib": str(root)})
    stdlib_split.cache_clear()
    yield root
    stdlib_split.cache_clear()


def _relative(files: list[str]) -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    return [os.path.relpath(f, root) for f in files]


def _top_level(relative: str) -> str:
    return relative.split(os.sep)[0].removesuffix(".py")


def test_the_interpreter_stdlib_splits_into_disjoint_sorted_training_and_held_out_modules():
    train, held_out = stdlib_files(STDLIB), stdlib_files(STDLIB_HELD_OUT)
    assert train == stdlib_files(STDLIB) and held_out == stdlib_files(STDLIB_HELD_OUT)
    assert _relative(train) == sorted(_relative(train)) and len(held_out) >= 32
    assert not {_top_level(r) for r in _relative(train)} & {
        _top_level(r) for r in _relative(held_out)
    }
    held_bytes = sum(os.path.getsize(f) for f in held_out)
    assert 0.05 < held_bytes / (held_bytes + sum(os.path.getsize(f) for f in train)) <= 1 / 8
    assert not any(f"{os.sep}test{os.sep}" in f for f in train + held_out)


def _long_lines(path: str) -> set[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        return {line.strip() for line in f if len(line.strip()) >= 24}


def test_no_held_out_file_has_a_near_copy_in_training():
    training_lines = set().union(*(_long_lines(f) for f in stdlib_files(STDLIB)))
    for path in stdlib_files(STDLIB_HELD_OUT):
        lines = _long_lines(path)
        shared = len(lines & training_lines) / max(len(lines), 1)
        assert shared <= STDLIB_MAX_LINE_OVERLAP, f"{path}: {shared:.0%} of its lines in training"


def test_a_held_out_file_that_copies_a_training_file_is_dropped(tmp_path):
    root = tmp_path / "lib"
    root.mkdir()
    for i in range(16):
        (root / f"m{i:02d}.py").write_text(
            "".join(f"value_{i}_{j} = compute_something({j})\n" for j in range(50))
        )
    split = stdlib_split(str(root))
    assert split.held_out and not split.dropped
    copied = root / split.held_out[0]
    copied.write_text((root / split.training[0]).read_text())
    stdlib_split.cache_clear()
    split = stdlib_split(str(root))
    assert split.dropped == [copied.name] and split.overlap[copied.name] == 1.0
    assert copied.name not in split.held_out + split.training
    stdlib_split.cache_clear()


def test_the_split_leaves_out_tests_and_installed_packages(fake_stdlib):
    split = stdlib_split(str(fake_stdlib))
    everything = split.training + split.held_out + split.dropped
    assert sorted(everything) == ["a.py", os.path.join("pkg", "b.py")]


def test_each_stdlib_file_is_one_document(fake_stdlib):
    docs = list(source_documents(STDLIB)) + list(source_documents(STDLIB_HELD_OUT))
    assert sorted(doc.text for doc in docs) == ["# a.py\n", "# pkg/b.py\n"]


def test_a_python_without_stdlib_sources_is_a_clear_error(tmp_path, monkeypatch):
    paths = sysconfig.get_paths()
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {**paths, "stdlib": str(tmp_path)})
    stdlib_split.cache_clear()
    with pytest.raises(ValueError, match=r"no standard library [.]py files under"):
        stdlib_files(STDLIB)
    with pytest.raises(ValueError, match=r"no standard library [.]py files under"):
        validate_for_runtime(preset("stdlib_bytes"), n_devices=1)


def test_only_the_stdlib_corpus_has_a_held_out_split():
    assert held_out_source(STDLIB) == STDLIB_HELD_OUT
    with pytest.raises(ValueError, match=r"data[.]path: 'docs[.]jsonl' has no held-out split"):
        held_out_source("docs.jsonl")


def test_held_out_files_give_sequences_of_32_training_lengths():
    cfg, tokenizer = preset("stdlib_bytes"), ByteTokenizer()
    row_len = 32 * cfg.seq_len + 1
    encoded = (
        [tokenizer.bos_id, *tokenizer.encode(doc.text)] for doc in source_documents(STDLIB_HELD_OUT)
    )
    long_files = [tokens for tokens in encoded if len(tokens) >= row_len]
    rows = load_rows(STDLIB_HELD_OUT, tokenizer, row_len - 1, 32, packing="documents")
    assert len(long_files) >= 16, "this Python's held-out standard library split is too small"
    assert rows.shape == (min(32, len(long_files)), row_len)
    assert rows[0].tolist() == list(long_files[0][:row_len])


def test_stdlib_bytes_gives_every_encoding_the_same_recipe():
    cfg = preset("stdlib_bytes")
    validate_for_runtime(cfg, n_devices=1)
    assert (cfg.data.source, cfg.data.path, cfg.data.tokenizer) == ("text", STDLIB, "byte")
    assert cfg.seq_len == 256 and cfg.model.vocab_size == ByteTokenizer().vocab_size
    assert cfg.model.attention_impl == "blockwise" and not cfg.model.global_prior
    assert cfg.model.local_layers == 0 and cfg.ssmax_jitter == 0 and cfg.prior_dilation == 1
    for encoding in COMPARE_ENCODINGS.split(","):
        other = quickstart_config(encoding, preset_name="stdlib_bytes")
        assert other.replace(model=other.model.replace(encoding="bam_ssmax")) == cfg
