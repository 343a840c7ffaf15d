"""Training data through grain: rows of `seq_len + 1` tokens, batched per host.

Every source is a random-access list of rows, so a run is a pure function of the seed and the
step, and the grain iterator state (one index) is all a checkpoint needs to resume exactly.

A row is a dict of numpy arrays of length `seq_len`:
  inputs, targets  int32   tokens and next tokens
  segment_ids      int32   document id per input token (-1 = padding, never attended)
  positions        int32   position of each input token inside its document
  loss_mask        float32 1 where the target is trained on
  loss_positions   int32 [P]  (passkey rows trained on the answer only) the P positions whose
                   targets are trained, so that only they need logits

Sources:
  passkey  synthetic passkey-retrieval prompts (docs/spec.md section 10) with varied filler, needle
           depth and length; only the answer digits are trained on by default.
  text     local .txt files (one document each) and .jsonl files (one document per line),
           tokenised with BOS/EOS and concatenated with document ids.
  shards   pre-tokenised .npy shards (see train/shards.py), memory-mapped.

The global batch of step s is rows [s * G, (s + 1) * G) of the (shuffled, repeated) row
list, G = accum_steps * batch_size; it is laid out as [accum_steps, batch_size, seq_len] and
each process reads only the rows of its slice of the batch axis.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Sequence

import grain
import numpy as np

from bam_configs.training import DataConfig
from bam_jax import passkey
from bam_jax.io.documents import Document, source_documents
from bam_jax.io.shards import open_shards, read_meta
from bam_jax.retrieval import RetrievalTask, build_task_sample, task_min_length
from bam_jax.tokenizers import Tokenizer, encode_checked, get_tokenizer, special_id
from bam_train.copy_seeding import with_copy_documents

Row = dict[str, np.ndarray]


def empty_row(seq_len: int) -> Row:
    return {
        "inputs": np.zeros(seq_len, np.int32),
        "targets": np.zeros(seq_len, np.int32),
        "segment_ids": np.full(seq_len, -1, np.int32),
        "positions": np.zeros(seq_len, np.int32),
        "loss_mask": np.zeros(seq_len, np.float32),
    }


# ----------------------------------------------------------------------------- passkey


def varied_filler(rng: np.random.Generator) -> str:
    """A filler paragraph in the style of the paper's, from random simple sentences."""
    sentences = []
    for _ in range(int(rng.integers(3, 7))):
        if rng.random() < 0.75:
            noun = rng.choice(passkey.FILLER_NOUNS)
            adjective = rng.choice(passkey.FILLER_ADJECTIVES)
            sentences.append(passkey.FILLER_SENTENCE.format(noun=noun, adjective=adjective))
        else:
            sentences.append(str(rng.choice(passkey.FILLER_PHRASES)))
    return " ".join(sentences)


class PasskeyRows:
    """Row i is a passkey prompt drawn from `seed` and i: any filler, length and depth."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, seed: int):
        self.cfg, self.tokenizer, self.seq_len, self.seed = cfg, tokenizer, seq_len, seed
        widest_key = 10 ** (passkey.PREDICTED_DIGITS + cfg.passkey_prefix_digits) - 1
        self.key_tokens = len(tokenizer.encode(f" {widest_key}"))
        self.max_prompt = seq_len + 1 - self.key_tokens
        template = passkey.passkey_template(tokenizer, prefix_digits=cfg.passkey_prefix_digits)
        self.task_length = len(template.task)
        self.min_prompt = max(template.min_length, cfg.passkey_min_length)
        shortest = self._shortest(0 if cfg.passkey_task_fraction >= 1.0 else self.task_length)
        if cfg.passkey_lm_positions >= shortest:
            raise ValueError(
                f"data.passkey_lm_positions ({cfg.passkey_lm_positions}) must be below the "
                f"shortest prompt's {shortest} tokens"
            )
        if self.min_prompt > self.max_prompt:
            raise ValueError(
                f"model.max_seq_len: a passkey prompt needs at least {template.min_length} "
                f"tokens plus {self.key_tokens} key tokens with tokenizer "
                f"{tokenizer.name!r}; got seq_len {seq_len} (and data.passkey_min_length "
                f"{cfg.passkey_min_length})"
            )
        self.multikey = RetrievalTask("multikey", max(2, cfg.passkey_multikey_needles))
        self.multikey_min = task_min_length(tokenizer, self.multikey, cfg.passkey_prefix_digits)
        if cfg.passkey_multikey_fraction > 0 and self.multikey_min > self.max_prompt:
            raise ValueError(
                f"data.passkey_multikey_needles: {self.multikey.needles} needles need prompts "
                f"of {self.multikey_min} tokens, more than the {self.max_prompt} that "
                f"model.max_seq_len {seq_len} leaves"
            )

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, index: int) -> Row:
        rng = np.random.default_rng([self.seed, int(index)])
        use_paper = rng.random() < self.cfg.passkey_paper_filler_fraction
        filler = passkey.FILLER if use_paper else varied_filler(rng)
        fraction = self.cfg.passkey_task_fraction
        skipped = 0 if fraction >= 1.0 or rng.random() < fraction else self.task_length
        multikey = self.cfg.passkey_multikey_fraction
        if multikey > 0 and rng.random() < multikey:
            shortest = max(self._shortest(skipped), self.multikey_min - skipped)
            target = int(rng.integers(shortest, self.max_prompt + 1))
            sample = build_task_sample(
                self.tokenizer,
                self.multikey,
                target + skipped,
                rng,
                float(rng.random()),
                self.cfg.passkey_prefix_digits,
                filler,
            )
        else:
            target = int(rng.integers(self._shortest(skipped), self.max_prompt + 1))
            sample = passkey.build_passkey_sample(
                self.tokenizer,
                target + skipped,
                key=passkey.random_key(rng, self.cfg.passkey_prefix_digits),
                depth=float(rng.random()),
                prefix_digits=self.cfg.passkey_prefix_digits,
                filler=filler,
            )
        tokens = sample.tokens[skipped:]
        prompt_targets = sample.prompt_length - skipped - 1
        lm = rng.choice(prompt_targets, self.cfg.passkey_lm_positions, replace=False)
        return self._row(tokens, sample.answer_positions - skipped, np.sort(lm))

    def _shortest(self, skipped: int) -> int:
        """Shortest prompt when the task sentence's `skipped` tokens are left out."""
        return max(self.min_prompt - skipped, self.cfg.passkey_min_length)

    def _row(
        self, tokens: np.ndarray, answer_positions: np.ndarray, lm_positions: np.ndarray
    ) -> Row:
        n = len(tokens) - 1
        row = empty_row(self.seq_len)
        row["inputs"][:n] = tokens[:-1]
        row["targets"][:n] = tokens[1:]
        row["segment_ids"][:n] = 0
        row["positions"][:n] = np.arange(n)
        if self.cfg.passkey_loss == "answer":
            trained = np.concatenate([lm_positions, answer_positions - 1]).astype(np.int32)
            row["loss_mask"][trained] = 1.0
            row["loss_positions"] = trained
        else:
            row["loss_mask"][:n] = 1.0
        return row


def loss_positions_per_row(cfg: DataConfig) -> int | None:
    """P when every row carries `loss_positions` [P], else None."""
    if cfg.source == "passkey" and cfg.passkey_loss == "answer":
        return passkey.PREDICTED_DIGITS + cfg.passkey_lm_positions
    return None


# ----------------------------------------------------------------------------- token streams


class TokenStreamRows:
    """Rows cut with stride seq_len from a flat token stream with document start offsets,
    starting `skip_tokens` tokens into the stream (counted over the shards in order).

    Rows never cross a shard boundary; a target in another document than its input (the
    EOS -> next BOS step) is not trained on unless `boundary_targets`.
    """

    def __init__(
        self,
        streams: Sequence[tuple[np.ndarray, np.ndarray]],
        seq_len: int,
        vocab_size: int | None = None,
        *,
        skip_tokens: int = 0,
        boundary_targets: bool = False,
    ):
        """With `vocab_size`, every row's ids are checked against [0, vocab_size) as it is
        read (two reductions over a row; a shard damaged after its ids were recorded)."""
        self.streams, self.seq_len, self.vocab_size = list(streams), seq_len, vocab_size
        self.boundary_targets = boundary_targets
        lengths = np.asarray([len(tokens) for tokens, _ in self.streams], np.int64)
        before = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self.first_token = np.clip(skip_tokens - before, 0, None)
        rows = [
            max((int(n) - int(first) - 1) // seq_len, 0)
            for n, first in zip(lengths, self.first_token, strict=True)
        ]
        self.first_row = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.first_row[-1])

    def __getitem__(self, index: int) -> Row:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range [0, {len(self)})")
        shard = int(np.searchsorted(self.first_row, index, side="right")) - 1
        tokens, doc_starts = self.streams[shard]
        row_in_shard = index - int(self.first_row[shard])
        start = int(self.first_token[shard]) + row_in_shard * self.seq_len
        window = np.asarray(tokens[start : start + self.seq_len + 1], dtype=np.int32)
        if self.vocab_size is not None:
            self._check_ids(shard, start, window)
        doc_of = np.searchsorted(doc_starts, np.arange(start, start + self.seq_len + 1), "right")
        doc_of = doc_of.astype(np.int64) - 1
        segment = (doc_of - doc_of[0]).astype(np.int32)
        trained = (
            np.ones(self.seq_len, np.float32)
            if self.boundary_targets
            else (segment[1:] == segment[:-1]).astype(np.float32)
        )
        return {
            "inputs": window[:-1],
            "targets": window[1:],
            "segment_ids": segment[:-1],
            "positions": (np.arange(start, start + self.seq_len) - doc_starts[doc_of[:-1]]).astype(
                np.int32
            ),
            "loss_mask": trained,
        }

    def _check_ids(self, shard: int, start: int, window: np.ndarray) -> None:
        if window.min() >= 0 and window.max() < self.vocab_size:
            return
        offset = int(np.flatnonzero((window < 0) | (window >= self.vocab_size))[0])
        tokens = self.streams[shard][0]
        source = getattr(tokens, "filename", None) or f"shard {shard}"
        raise ValueError(
            f"{source}: token id {window[offset]} at position {start + offset}, outside the "
            f"vocabulary [0, {self.vocab_size}); the data is damaged or was written with "
            "another tokenizer: write the shards again with `python -m bam_train.shards`"
        )


def tokenize_documents(
    docs: Iterable[Document], tokenizer: Tokenizer, *, add_bos: bool = True, add_eos: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated int32 tokens and the int64 start offset of every document.

    Every id is in [0, tokenizer.vocab_size): a missing BOS/EOS or an id the tokenizer
    produces outside its vocabulary is a ValueError naming the tokenizer (and the document).
    """
    bos = [special_id(tokenizer, "bos", "or set data.add_bos=False")] if add_bos else []
    eos = [special_id(tokenizer, "eos", "or set data.add_eos=False")] if add_eos else []
    bos_ids, eos_ids = np.asarray(bos, np.int64), np.asarray(eos, np.int64)
    pieces, starts, total = [], [], 0
    for doc in docs:
        ids = np.concatenate([bos_ids, encode_checked(tokenizer, doc.text, doc.where), eos_ids])
        starts.append(total)
        pieces.append(ids.astype(np.int32))
        total += len(ids)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    return tokens, np.asarray(starts, np.int64)


# ----------------------------------------------------------------------------- assembly


def build_rows(cfg: DataConfig, seq_len: int, seed: int, split: str) -> grain.MapDataset:
    """All rows of one split ("train" or "val") as a random-access grain dataset."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if cfg.source == "passkey":
        split_seed = seed if split == "train" else seed + 1_000_003
        return grain.MapDataset.source(
            PasskeyRows(cfg, get_tokenizer(cfg.tokenizer), seq_len, split_seed)
        )
    if split == "val":
        rows = grain.MapDataset.source(_stream_rows(cfg, seq_len))
        if len(rows) <= cfg.val_rows:
            raise ValueError(
                f"data.path: {cfg.path!r} gives {len(rows)} rows of {seq_len + 1} tokens, not "
                f"more than data.val_rows={cfg.val_rows}; add data or lower val_rows / seq_len"
            )
        return rows[: cfg.val_rows]
    skip_tokens = cfg.val_rows * seq_len + cfg.val_gap_tokens
    rows = grain.MapDataset.source(_stream_rows(cfg, seq_len, skip_tokens))
    if not len(rows):
        raise ValueError(
            f"data.path: {cfg.path!r} has not more than data.val_rows={cfg.val_rows} rows of "
            f"{seq_len + 1} tokens (plus data.val_gap_tokens={cfg.val_gap_tokens} tokens), so "
            "no row is left for training; add data or lower val_rows / val_gap_tokens / seq_len"
        )
    if cfg.shuffle:
        rows = rows.shuffle(seed=seed)
    return rows.repeat(None)


def _stream_rows(cfg: DataConfig, seq_len: int, skip_tokens: int = 0) -> TokenStreamRows:
    options = {"skip_tokens": skip_tokens, "boundary_targets": cfg.boundary_targets}
    if cfg.source == "shards":
        vocab_size = read_meta(cfg.path)["vocab_size"]
        return TokenStreamRows(open_shards(cfg.path), seq_len, vocab_size, **options)
    tokenizer = get_tokenizer(cfg.tokenizer)
    docs = with_copy_documents(source_documents(cfg.path, cfg.text_key), cfg.copy_seeding)
    stream = tokenize_documents(docs, tokenizer, add_bos=cfg.add_bos, add_eos=cfg.add_eos)
    return TokenStreamRows([stream], seq_len, **options)


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """Which rows of each global batch this process reads: rows [row_start, row_start +
    row_count) of each of the `accum_steps` micro-batches of `batch_size` rows."""

    accum_steps: int
    batch_size: int
    row_start: int = 0
    row_count: int = 0

    @property
    def local_batch(self) -> int:
        return self.row_count or self.batch_size

    def global_row(self, k: int) -> int:
        """Global row index of this process's k-th row."""
        step, rest = divmod(k, self.accum_steps * self.local_batch)
        micro, i = divmod(rest, self.local_batch)
        return (step * self.accum_steps + micro) * self.batch_size + self.row_start + i


def local_batches(rows: grain.MapDataset, layout: BatchLayout) -> grain.MapDataset:
    """This process's batches: dicts of [accum_steps, local_batch, seq_len] arrays."""
    per_step = layout.accum_steps * layout.batch_size
    n_steps = len(rows) // per_step
    n_local = n_steps * layout.accum_steps * layout.local_batch
    mine = grain.MapDataset.range(n_local).map(lambda k: rows[layout.global_row(k)])
    return mine.batch(layout.local_batch, drop_remainder=True).batch(
        layout.accum_steps, drop_remainder=True
    )


def train_iterator(
    cfg: DataConfig, seq_len: int, seed: int, layout: BatchLayout
) -> grain.DatasetIterator:
    """Checkpointable iterator over this process's training batches."""
    batches = local_batches(build_rows(cfg, seq_len, seed, "train"), layout)
    options = grain.ReadOptions(num_threads=cfg.num_threads, prefetch_buffer_size=cfg.prefetch)
    return iter(batches.to_iter_dataset(options))


def val_batches(
    cfg: DataConfig, seq_len: int, seed: int, layout: BatchLayout, n_batches: int
) -> list[Row]:
    """The validation set (the same every time): this process's rows of the first
    `n_batches` micro-batches of `layout.batch_size` rows, each [1, local_batch, seq_len].

    A validation batch is one micro-batch, not a whole optimizer step: evaluation needs no
    gradient accumulation, so `n_batches * batch_size` held-out rows are enough.
    """
    micro = BatchLayout(1, layout.batch_size, layout.row_start, layout.row_count)
    batches = local_batches(build_rows(cfg, seq_len, seed, "val"), micro)
    if len(batches) < n_batches:
        raise ValueError(
            f"eval_batches: {n_batches} validation batches of batch_size={layout.batch_size} "
            f"rows need {n_batches * layout.batch_size} held-out rows, data.val_rows gives "
            f"{len(batches) * layout.batch_size}; raise data.val_rows or lower eval_batches"
        )
    return [batches[i] for i in range(n_batches)]
