"""Tokenisers behind one small protocol, all usable offline.

- "mistral": the Mistral-7B v0.3 SentencePiece model (vocabulary 32768, BOS 1, EOS 2) that
  ships inside the `mistral-common` package, so no hub download is needed.
- "byte": UTF-8 bytes shifted by three special ids (pad 0, BOS 1, EOS 2); vocabulary 259.
- a path to a SentencePiece `.model` file or a Hugging Face `tokenizer.json` file.
- "passkey:BASE" (e.g. "passkey:mistral"): BASE restricted to the tokens of the paper's
  passkey strings (79 ids for Mistral's, renumbered from 0), for models that only ever read passkey
  prompts: their embedding and output layers shrink from BASE's vocabulary to this one.

`encode` never adds BOS/EOS; callers add them where a format asks for them. Where data
enters a model, `special_id` and `encode_checked` make sure every id lies in
[0, vocab_size): the model reads an id past its vocabulary as a row of NaN and wraps a
negative one (see `bam_jax.model.Transformer`). `decode` shows an id past the vocabulary (a
padded output layer's row) as U+FFFD.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np

from bam_jax.passkey import vocabulary_texts

MISTRAL_V3_MODEL = "mistral_instruct_tokenizer_240323.model.v3"


HF_PREFIX = "hf:"


@runtime_checkable
class Tokenizer(Protocol):
    name: str

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class SentencePieceTokenizer:
    """A SentencePiece model read from a file."""

    def __init__(self, path: str, name: str | None = None):
        import sentencepiece

        if not os.path.isfile(path):
            raise ValueError(f"tokenizer: SentencePiece model file {path!r} does not exist")
        self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        self.path = path
        self.name = name or path

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def bos_id(self) -> int:
        return int(self._sp.bos_id())

    @property
    def eos_id(self) -> int:
        return int(self._sp.eos_id())

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text, out_type=int))

    def decode(self, ids: list[int]) -> str:
        return decode_in_vocabulary(ids, self.vocab_size, self._sp.decode)


class ByteTokenizer:
    """UTF-8 bytes; ids 0, 1, 2 are pad, BOS and EOS, byte b is id b + 3."""

    name = "byte"
    pad_id = 0
    offset = 3

    @property
    def vocab_size(self) -> int:
        return 256 + self.offset

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return decode_in_vocabulary(ids, self.vocab_size, self._decode_bytes)

    def _decode_bytes(self, ids: list[int]) -> str:
        data = bytes(i - self.offset for i in ids if i >= self.offset)
        return data.decode("utf-8", errors="replace")


class HuggingFaceTokenizer:
    """A `tokenizer.json` file read with the `tokenizers` library (extra `hf`)."""

    def __init__(self, path: str):
        if importlib.util.find_spec("tokenizers") is None:
            raise ValueError(
                f"tokenizer: {path!r} is a tokenizer.json file, which needs the `tokenizers` "
                "package (pip install 'bam-jax[hf]')"
            )
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(path)
        self.name = path
        self._bos, self._eos = _hf_special_ids(path, self._tok)
        # A vocabulary may skip ids, so its entry count is no bound on them.
        self._vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @property
    def vocab_size(self) -> int:
        """One more than the largest id."""
        return self._vocab_size

    @property
    def bos_id(self) -> int:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return decode_in_vocabulary(ids, self.vocab_size, self._decode_known)

    def _decode_known(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def _hf_special_ids(path: str, tok) -> tuple[int, int]:
    """BOS/EOS ids from the usual token names; -1 where the file has none."""
    with open(path, encoding="utf-8") as f:
        added = {t["content"]: t["id"] for t in json.load(f).get("added_tokens", [])}

    def find(*names: str) -> int:
        for n in names:
            if n in added:
                return int(added[n])
            token_id = tok.token_to_id(n)
            if token_id is not None:
                return int(token_id)
        return -1

    return find("<s>", "<|begin_of_text|>", "<bos>"), find(
        "</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"
    )


class PasskeyVocabulary:
    """A base tokeniser restricted to the ids that the passkey strings encode to.

    Compact ids are BOS, EOS, then the base ids in increasing order. Encoding text that needs
    any other base id is a ValueError, so the restriction never changes a prompt silently. A
    model's vocabulary may be padded past `vocab_size`; those ids decode to U+FFFD.
    """

    def __init__(self, base: Tokenizer):
        self.base = base
        self.name = f"passkey:{base.name}"
        specials = (special_id(base, "bos"), special_id(base, "eos"))
        self.base_ids = (*specials, *sorted(_passkey_base_ids(base)))
        self._compact = {base_id: i for i, base_id in enumerate(self.base_ids)}

    @property
    def vocab_size(self) -> int:
        return len(self.base_ids)

    @property
    def bos_id(self) -> int:
        return 0

    @property
    def eos_id(self) -> int:
        return 1

    def encode(self, text: str) -> list[int]:
        base_ids = self.base.encode(text)
        missing = sorted({i for i in base_ids if i not in self._compact})
        if missing:
            raise ValueError(
                f"tokenizer {self.name!r} only knows the tokens of the passkey strings; "
                f"{text[:60]!r} needs {self.base.name} ids {missing[:10]}"
            )
        return [self._compact[i] for i in base_ids]

    def decode(self, ids: list[int]) -> str:
        return decode_in_vocabulary(ids, self.vocab_size, self._decode_compact)

    def _decode_compact(self, ids: list[int]) -> str:
        return self.base.decode([self.base_ids[i] for i in ids])


def decode_in_vocabulary(
    ids: list[int], vocab_size: int, decode_known: Callable[[list[int]], str]
) -> str:
    """`decode_known` over each run of ids in [0, vocab_size); any other id shows as U+FFFD."""
    text, run = [], []
    for i in map(int, ids):
        if 0 <= i < vocab_size:
            run.append(i)
            continue
        text += [decode_known(run) if run else "", "\ufffd"]
        run = []
    return "".join([*text, decode_known(run) if run else ""])


def special_id(tokenizer: Tokenizer, kind: str, remedy: str = "") -> int:
    """The tokenizer's "bos" or "eos" id, refused when it has none (-1) or it lies outside
    the vocabulary; `remedy` ends the error (e.g. the option that drops the token)."""
    token_id = int(getattr(tokenizer, f"{kind}_id"))
    if not 0 <= token_id < tokenizer.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.name!r} has no {kind.upper()} token ({kind}_id {token_id}, "
            f"vocabulary [0, {tokenizer.vocab_size})); use a tokenizer that defines one"
            + (f" {remedy}" if remedy else "")
        )
    return token_id


def encode_checked(tokenizer: Tokenizer, text: str, where: str) -> np.ndarray:
    """int64 ids of `text`, refused when one lies outside [0, vocab_size): the error names
    the tokenizer, `where` the text came from (e.g. "FILE line N") and the first bad id."""
    ids = np.asarray(tokenizer.encode(text), np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= tokenizer.vocab_size))
    if bad.size:
        raise ValueError(
            f"{where}: tokenizer {tokenizer.name!r} encoded the text to id {ids[bad[0]]} "
            f"(token {bad[0]}), outside its vocabulary [0, {tokenizer.vocab_size}); the "
            "tokenizer file is inconsistent, use another tokenizer"
        )
    return ids


def _passkey_base_ids(base: Tokenizer) -> set[int]:
    ids = {i for text in vocabulary_texts() for i in base.encode(text)}
    return ids - {base.bos_id, base.eos_id}


def mistral_model_path() -> str:
    """Path of the Mistral-7B v0.3 SentencePiece model inside the installed mistral_common."""
    spec = importlib.util.find_spec("mistral_common")
    if spec is None or spec.origin is None:
        raise ValueError("tokenizer: 'mistral' needs the `mistral-common` package installed")
    path = os.path.join(os.path.dirname(spec.origin), "data", MISTRAL_V3_MODEL)
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer: mistral_common has no {MISTRAL_V3_MODEL} at {path}")
    return path


@functools.lru_cache(maxsize=16)
def get_tokenizer(spec: str = "mistral") -> Tokenizer:
    """A tokeniser from "mistral", "byte", "passkey:BASE", a SentencePiece .model file, a
    tokenizer.json file or a directory holding one, or "hf:NAME" (the tokenizer.json of a
    Hugging Face model in the local Hugging Face cache; nothing is downloaded)."""
    if spec.startswith("passkey:"):
        return PasskeyVocabulary(get_tokenizer(spec.removeprefix("passkey:")))
    if spec == "mistral":
        return SentencePieceTokenizer(mistral_model_path(), name="mistral")
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith(HF_PREFIX):
        return HuggingFaceTokenizer(_cached_tokenizer_json(spec.removeprefix(HF_PREFIX)))
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "tokenizer.json")):
        return HuggingFaceTokenizer(os.path.join(spec, "tokenizer.json"))
    if spec.endswith(".json"):
        if not os.path.isfile(spec):
            raise ValueError(f"tokenizer: file {spec!r} does not exist")
        return HuggingFaceTokenizer(spec)
    if os.path.isfile(spec):
        return SentencePieceTokenizer(spec)
    raise ValueError(
        f"tokenizer: expected 'mistral', 'byte', 'passkey:BASE', 'hf:NAME', a .model or "
        f"tokenizer.json file, or a directory holding a tokenizer.json, got {spec!r}"
    )


def _cached_tokenizer_json(name: str) -> str:
    """The path of model `name`'s tokenizer.json in the local Hugging Face cache."""
    if importlib.util.find_spec("huggingface_hub") is None:
        raise ValueError(
            f"tokenizer: 'hf:{name}' needs the `tokenizers` package (pip install 'bam-jax[hf]')"
        )
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return huggingface_hub.hf_hub_download(name, "tokenizer.json", local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError) as err:
        raise ValueError(
            f"tokenizer: 'hf:{name}' has no tokenizer.json in the local Hugging Face cache "
            f"({type(err).__name__}); fetch it once with network "
            f"(`huggingface-cli download {name} tokenizer.json`) or pass a local path"
        ) from err
