"""Compressed tokenizer: raw token id -> compressed id (spec section 1).

Tokens that differ only by case, accents, Unicode form or surrounding whitespace share one
compressed id, so n-gram tables are not wasted on spelling variants. The table depends on the
tokenizer file and on this normalizer; since it also fixes the hash multipliers (through the
compressed vocabulary size V'), every address depends on it. Building it decodes every id, so
it is cached on disk keyed by the sha256 of the tokenizer file.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from engram_train.errors import ConfigError, InputError, InputTypeError

# Bump when the key rule or the normalizer changes: old cache files then stop matching.
_CACHE_FORMAT = "v1"
_REPLACEMENT_CHAR = "\ufffd"
_SENTINEL = "\ue000"


def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


class TokenizerNotFoundError(ConfigError, FileNotFoundError):
    """No ``tokenizer.json`` where a config field points."""


def resolve_tokenizer_file(
    name_or_path: str | os.PathLike, field: str = "engram_tokenizer_name_or_path", hint: str = ""
) -> Path:
    """The ``tokenizer.json`` that `name_or_path` names (the file, or the one in the folder);
    hub names are not fetched. The error names the config `field` to fix."""
    path = Path(name_or_path).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise TokenizerNotFoundError(
            f"{field}: no tokenizer.json at '{name_or_path}'. Set {field} to a local Hugging Face "
            f"tokenizer.json or the folder holding one (download it beforehand){hint}."
        )
    return file


def default_cache_dir() -> Path:
    """The package's cache (compressed-vocabulary lookups, dataset helpers and indices):
    `$ENGRAM_CACHE_DIR`, else `$XDG_CACHE_HOME/engram_train`, else `~/.cache/engram_train`."""
    env = os.environ.get("ENGRAM_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(root).expanduser() / "engram_train"


def build_compressed_lookup(tokenizer_file: str | os.PathLike) -> np.ndarray:
    """Compute the raw -> compressed table (int64 [V]) from scratch; see module docstring."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    texts = tok.decode_batch([[i] for i in range(vocab_size)], skip_special_tokens=False)
    normalize = _normalizer().normalize_str
    key_to_id: dict[str, int] = {}
    lookup = np.empty(vocab_size, dtype=np.int64)
    for raw_id, text in enumerate(texts):
        if _REPLACEMENT_CHAR in text:  # partial UTF-8 byte token: keep it distinct
            key = tok.id_to_token(raw_id)
        else:
            key = normalize(text) or text
        lookup[raw_id] = key_to_id.setdefault(key, len(key_to_id))
    return lookup


class CompressedTokenizer:
    """Raw -> compressed id table for one tokenizer file.

    Attributes: `lookup` (np.int64 [V]), `num_raw_ids` (V, added tokens included),
    `vocab_size` (V', the number of distinct compressed ids), `sha256` of the file.
    """

    def __init__(
        self,
        name_or_path: str | os.PathLike,
        cache_dir: str | os.PathLike | None = None,
        use_cache: bool = True,
    ) -> None:
        self.tokenizer_file = resolve_tokenizer_file(name_or_path)
        self.sha256 = hashlib.sha256(self.tokenizer_file.read_bytes()).hexdigest()
        cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self.cache_file = cache_dir / f"compressed_lookup_{_CACHE_FORMAT}_{self.sha256}.npy"
        lookup = self._load_cache() if use_cache else None
        if lookup is None:
            lookup = build_compressed_lookup(self.tokenizer_file)
            if use_cache:
                self._save_cache(lookup)
        self.lookup = lookup
        self._lookup_torch = torch.from_numpy(lookup)
        self.num_raw_ids = int(lookup.shape[0])
        self.vocab_size = int(lookup.max()) + 1 if lookup.size else 0

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (
            f"CompressedTokenizer({str(self.tokenizer_file)!r}, num_raw_ids={self.num_raw_ids}, "
            f"vocab_size={self.vocab_size})"
        )

    def _load_cache(self) -> np.ndarray | None:
        try:
            lookup = np.load(self.cache_file, allow_pickle=False)
        except (OSError, ValueError):
            return None
        if lookup.dtype != np.int64 or lookup.ndim != 1:
            return None
        return lookup

    def _save_cache(self, lookup: np.ndarray) -> None:
        # tmp file + os.replace: concurrent ranks never read a half-written table.
        try:
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.cache_file.parent, suffix=".npy.tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    np.save(f, lookup, allow_pickle=False)
                os.replace(tmp, self.cache_file)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as err:
            warnings.warn(
                f"could not cache the compressed tokenizer table at {self.cache_file} ({err}); "
                "set ENGRAM_CACHE_DIR to a writable folder to avoid rebuilding it.",
                stacklevel=3,
            )

    def compress(self, ids: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
        """Map raw ids (any shape) to compressed ids; numpy in, numpy out; torch in, torch out."""
        if isinstance(ids, torch.Tensor):
            check_raw_ids(ids, self.num_raw_ids)
            return self._lookup_torch.to(ids.device)[ids.long()]
        arr = np.asarray(ids)
        check_raw_ids(arr, self.num_raw_ids)
        return self.lookup[arr]

    __call__ = compress


def check_raw_ids(ids: np.ndarray | torch.Tensor, num_raw_ids: int) -> None:
    """Raise a ValueError naming the first id outside [0, num_raw_ids)."""
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise InputTypeError(f"token ids must be an integer tensor, got dtype {ids.dtype}.")
    elif not np.issubdtype(ids.dtype, np.integer):
        raise InputTypeError(f"token ids must be an integer array, got dtype {ids.dtype}.")
    if math.prod(ids.shape) == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo >= 0 and hi < num_raw_ids:
        return
    bad_value = lo if lo < 0 else hi
    flat = ids.reshape(-1)
    first = int((flat == bad_value).nonzero()[0][0])
    index = tuple(int(i) for i in np.unravel_index(first, tuple(ids.shape)))
    raise InputError(
        f"token id {bad_value} at index {index} is outside the tokenizer's range [0, "
        f"{num_raw_ids}): the data was tokenized with another tokenizer than "
        "engram_tokenizer_name_or_path, or holds a sentinel; fix the data or the tokenizer path."
    )
