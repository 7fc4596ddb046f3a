"""A megatron-core tokenizer over a local Hugging Face ``tokenizer.json``.

megatron-core 0.16.1's ``GPTDatasetConfig``/``GPTDataset`` read ``vocab_size``, ``eod`` and
``pad`` from the tokenizer, json-encode its ``unique_identifiers`` into the dataset cache key,
and call ``tokenize``/``detokenize`` in preprocessing. Megatron's own
``MegatronTokenizer.from_pretrained`` needs a metadata file and, for Hugging Face tokenizers,
``transformers``; this adapter needs only the ``tokenizers`` library and the file itself.

Special ids: ``eod`` is the end-of-document id appended after every document; ``pad`` fills
partial samples. When the tokenizer has no separate pad token, ``pad == eod``, and
megatron's dataset then pads with a sentinel outside the vocabulary (masked out of the loss),
so real end-of-document tokens still count in the loss.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
from megatron.core.tokenizers import MegatronTokenizerBase

from engram_train.engram.compressed_tokenizer import TokenizerNotFoundError  # noqa: F401  (re-exported)
from engram_train.engram.compressed_tokenizer import resolve_tokenizer_file as _resolve
from engram_train.errors import ConfigError

# Looked up in order when the tokenizer folder has no tokenizer_config.json naming an EOS token.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]")


def resolve_tokenizer_file(path: str | os.PathLike, field: str = "data.tokenizer") -> Path:
    """Return the ``tokenizer.json`` that `path` names; an error names `field` (the config
    field, or a command's flag)."""
    return _resolve(path, field=field, hint="; the demo tokenizer is examples/data/tokenizer")


class HFTokenizer(MegatronTokenizerBase):
    """Megatron tokenizer interface over a ``tokenizers.Tokenizer`` loaded from a local file.

    Args:
        path: a ``tokenizer.json`` or a folder holding one (and optionally
            ``tokenizer_config.json``, whose ``eos_token``/``pad_token`` are used).
        eod_token: the end-of-document token; default: ``eos_token`` of
            ``tokenizer_config.json``, else the first of `EOD_CANDIDATES` in the vocabulary.
        pad_token: the padding token; default: ``pad_token`` of ``tokenizer_config.json``, else
            the first of `PAD_CANDIDATES` in the vocabulary, else the EOD token.

    ``tokenize`` never adds special tokens (no BOS, no post-processor template): documents are
    delimited by the EOD id that preprocessing appends.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        eod_token: str | None = None,
        pad_token: str | None = None,
        field: str = "data.tokenizer",
    ) -> None:
        from tokenizers import Tokenizer

        file = resolve_tokenizer_file(path, field)
        super().__init__(str(file), {})
        self.file = file
        self._tok = Tokenizer.from_file(str(file))
        self._sha256 = hashlib.sha256(file.read_bytes()).hexdigest()

        cfg = {}
        cfg_file = file.with_name("tokenizer_config.json")
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        self.eod_token = (
            eod_token or _token_str(cfg.get("eos_token")) or self._first(EOD_CANDIDATES)
        )
        if self.eod_token is None:
            raise ConfigError(
                f"{file}: cannot tell the end-of-document token; none of {EOD_CANDIDATES} is in "
                "the vocabulary. Pass eod_token (preprocess: --eod-token)."
            )
        self.pad_token = (
            pad_token
            or _token_str(cfg.get("pad_token"))
            or self._first(PAD_CANDIDATES)
            or self.eod_token
        )
        self._eod = self._id(self.eod_token, "eod_token")
        self._pad = self._id(self.pad_token, "pad_token")

    def _first(self, candidates: tuple[str, ...]) -> str | None:
        return next((t for t in candidates if self._tok.token_to_id(t) is not None), None)

    def _id(self, token: str, what: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise ConfigError(f"{self.file}: {what} {token!r} is not in the vocabulary.")
        return i

    # ---- encoding
    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """Tokenize many texts at once (parallel inside the Rust library)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def detokenize(self, ids) -> str:
        if isinstance(ids, np.ndarray) or hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("HFTokenizer is for pretraining data; it has no chat template.")

    # ---- vocabulary
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self.vocab.items()}

    # ---- special ids
    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def special_tokens_dict(self) -> dict[str, int]:
        """Special ids by role, as megatron's dataset checks them for collisions with ``pad``."""
        return {"eos_token": self._eod, "pad_token": self._pad}

    @property
    def unique_identifiers(self) -> OrderedDict:
        """Dataset cache key part: the tokenizer's content, not its path, plus the special ids."""
        ids = OrderedDict()
        ids["class"] = f"{type(self).__module__}.{type(self).__qualname__}"
        ids["tokenizer_sha256"] = self._sha256
        ids["eod"] = self._eod
        ids["pad"] = self._pad
        return ids

    def __repr__(self) -> str:
        return (
            f"HFTokenizer({str(self.file)!r}, vocab_size={self.vocab_size}, "
            f"eod={self.eod_token!r}:{self._eod}, pad={self.pad_token!r}:{self._pad})"
        )


def _token_str(value) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value or None


def load_tokenizer(
    path: str | os.PathLike, eod_token: str | None = None, pad_token: str | None = None,
    field: str = "data.tokenizer",
) -> HFTokenizer:
    """Load the tokenizer named by the ``data.tokenizer`` config field (or by `field`)."""
    return HFTokenizer(path, eod_token=eod_token, pad_token=pad_token, field=field)
