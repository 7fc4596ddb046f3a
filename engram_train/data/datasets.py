"""Train/valid/test GPT datasets with megatron-core's own builder (megatron-core 0.16.1, 0.19.2).

`build_gpt_datasets` is a thin, validated front for ``BlendedMegatronDatasetBuilder`` +
``GPTDatasetConfig`` + ``GPTDataset``: samples, splits, blending, shuffling and the on-disk index
cache are megatron's, so a run here and a Megatron-LM run over the same prefixes, seed, split
and sample counts see the same samples.

Every rank builds the datasets (``is_built_on_rank`` is always true): middle pipeline stages
need the token ids too, to hash them for Engram.

The C++ index helpers
---------------------
``GPTDataset`` builds its sample index with ``megatron.core.datasets.helpers_cpp``, a pybind11
extension. The megatron-core wheels on PyPI (0.16.1: CPython 3.10-3.13; 0.19.2: CPython 3.12;
manylinux x86_64 and aarch64) ship it prebuilt, so a fresh ``pip install`` needs no compiler.
A source install builds it as an *optional* extension and silently goes without it when that
fails, and megatron's ``compile_helpers()`` runs a Makefile that wheels do not ship; for that case
`ensure_dataset_helpers` compiles the ``helpers.cpp`` that every install carries, once, into
the cache folder (needs a C++ compiler and ``pip install pybind11``), under a file lock.

Races
-----
With ``torch.distributed`` initialized, megatron's builder builds the index cache on global
rank 0, then barriers, then the other ranks load it; the cache folder must therefore be one
that all ranks see. Independent processes (two jobs sharing a cache, or ranks launched without
a process group) are serialized by an exclusive ``flock`` on ``<cache>/.lock``, held by
global rank 0 only when a process group exists (a lock on every rank would deadlock against
the barrier).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import struct
import subprocess
import sys
import sysconfig
import warnings
from collections.abc import Sequence
from pathlib import Path

from engram_train.engram.compressed_tokenizer import default_cache_dir
from engram_train.errors import EngramError
from engram_train.runtime.patches import DATASET_PATCHES, apply_patches, megatron_core_version

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_DATA_PREFIX = str(REPO_ROOT / "examples" / "data" / "demo_text_document")
"""The shipped demo corpus (a source checkout; not part of an installed wheel)."""
DEMO_TOKENIZER = str(REPO_ROOT / "examples" / "data" / "tokenizer")


class DatasetError(EngramError, ValueError):
    """A dataset that cannot be trained on as given; the message names its files and the fix."""


class DatasetNotFoundError(DatasetError, FileNotFoundError):
    """No ``.bin``/``.idx`` pair at a prefix of ``data.path``."""


@contextlib.contextmanager
def file_lock(path: str | os.PathLike):
    """Exclusive advisory lock on `path` (created if missing) for the duration of the block."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- C++ helpers


def ensure_dataset_helpers(build_dir: str | os.PathLike | None = None) -> str:
    """Make ``megatron.core.datasets.helpers_cpp`` importable; return the path of the library.

    Uses the installed extension when there is one (the normal case); otherwise compiles
    megatron's ``helpers.cpp`` into `build_dir` (default: ``<cache>/helpers``) on first use and
    registers it under its megatron module name. Safe to call from many processes at once.
    """
    try:
        from megatron.core.datasets import helpers_cpp

        return helpers_cpp.__file__
    except ImportError:
        pass

    import megatron.core.datasets as mcd

    src = Path(mcd.__file__).with_name("helpers.cpp")
    if not src.is_file():
        raise RuntimeError(
            f"megatron-core has no helpers_cpp extension and no {src.name} to build it from; "
            f"reinstall it from a wheel: pip install --force-reinstall "
            f"megatron-core=={megatron_core_version()}"
        )
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
    out_dir = Path(build_dir or default_cache_dir() / "helpers") / digest
    lib = out_dir / f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"
    with file_lock(out_dir / ".lock"):
        if not lib.is_file():
            _compile_helpers(src, lib)
    name = "megatron.core.datasets.helpers_cpp"
    spec = importlib.util.spec_from_file_location(
        name, lib, loader=importlib.machinery.ExtensionFileLoader(name, str(lib))
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # `from megatron.core.datasets.helpers_cpp import ...` (megatron's helpers.py) finds it here.
    sys.modules[name] = module
    return str(lib)


def _compile_helpers(src: Path, lib: Path) -> None:
    try:
        import pybind11
    except ImportError:
        raise RuntimeError(
            "megatron-core was installed without its C++ dataset helpers (helpers_cpp), and "
            "building them needs pybind11: `pip install pybind11` (and a C++ compiler), or "
            f"reinstall megatron-core from a wheel: pip install --force-reinstall "
            f"megatron-core=={megatron_core_version()}"
        ) from None
    cxx = os.environ.get("CXX", "c++")
    tmp = lib.with_name(f"{lib.name}.{os.getpid()}.tmp")
    cmd = [
        cxx, "-O3", "-Wall", "-shared", "-std=c++17", "-fPIC",
        f"-I{sysconfig.get_paths()['include']}", f"-I{pybind11.get_include()}",
        str(src), "-o", str(tmp),
    ]  # fmt: skip
    logger.info("compiling megatron dataset helpers: %s", " ".join(cmd))
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise RuntimeError(f"no C++ compiler {cxx!r} to build megatron's dataset helpers") from None
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"building megatron's dataset helpers failed:\n{e.stderr}") from None
    os.replace(tmp, lib)


# --------------------------------------------------------------------------- datasets


def parse_blend(data_path) -> tuple[list[str], list[float] | None]:
    """Normalize a blend to megatron's ``(prefixes, weights or None)``.

    Accepted: one prefix; a list of prefixes (sampled in proportion to their sizes); megatron's
    flat list ``[w1, prefix1, w2, prefix2, ...]`` (weights as numbers or numeric strings); a list
    of ``(weight, prefix)`` pairs; a ``{prefix: weight}`` mapping.
    """
    if isinstance(data_path, (str, os.PathLike)):
        return [os.fspath(data_path)], None
    if isinstance(data_path, dict):
        return [os.fspath(p) for p in data_path], [float(w) for w in data_path.values()]
    items = list(data_path)
    if not items:
        raise DatasetError("data path: empty blend; give at least one dataset prefix.")
    if all(isinstance(x, (tuple, list)) and len(x) == 2 for x in items):
        return [os.fspath(p) for _, p in items], [float(w) for w, _ in items]

    def is_weight(x) -> bool:
        if isinstance(x, (int, float)):
            return True
        try:
            float(x)
            return True
        except (TypeError, ValueError):
            return False

    if len(items) % 2 == 0 and all(is_weight(w) for w in items[0::2]):
        return [os.fspath(p) for p in items[1::2]], [float(w) for w in items[0::2]]
    if any(is_weight(x) for x in items):
        raise DatasetError(
            f"data path: cannot read blend {items!r}; give prefixes only, or weight/prefix pairs "
            "like [0.3, 'a_text_document', 0.7, 'b_text_document']."
        )
    return [os.fspath(p) for p in items], None


def _document_lengths(prefix: str):
    """The document lengths of the dataset at ``prefix``; a missing, empty or unreadable
    ``.bin``/``.idx`` is a `DatasetError` naming the files (megatron would fail with ``cannot
    mmap an empty file`` or an assertion)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    files = f"{prefix}.bin and {prefix}.idx"
    if not IndexedDataset.exists(prefix):
        raise DatasetNotFoundError(
            f"data path: no dataset at prefix '{prefix}' (needs {files}); create one with engram-preprocess."
        )
    sizes = {ext: os.path.getsize(prefix + ext) for ext in (".bin", ".idx")}
    if not all(sizes.values()):
        empty = " and ".join(f"{prefix}{ext}" for ext, size in sizes.items() if not size)
        raise DatasetError(
            f"data path: {empty} {'is' if ' and ' not in empty else 'are'} empty (0 bytes): no "
            f"dataset to train on at '{prefix}'. Rebuild {files} with engram-preprocess from a "
            "non-empty corpus, or drop the prefix from data.path."
        )
    problem = _index_problem(prefix + ".idx")  # before megatron's reader, whose __del__
    if problem is None:                          # complains about a half-read index
        try:
            dataset = IndexedDataset(prefix)
            # a copy: the lengths are a view of the index's mmap, closed with `dataset`
            return dataset.sequence_lengths.astype("int64")
        except (ValueError, AssertionError, OSError, IndexError, struct.error) as e:
            problem = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    raise DatasetError(
        f"data path: cannot read {files} ({problem}): they are damaged or not an indexed dataset; "
        "rebuild them with engram-preprocess."
    )


_INDEX_MAGIC = b"MMIDIDX\x00\x00"
_INDEX_HEAD = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents


def _index_problem(idx_path: str) -> str | None:
    """Why megatron's indexed-dataset reader would fail on ``idx_path`` (its header, or a file
    shorter than the arrays the header announces), or None."""
    with open(idx_path, "rb") as stream:
        head = stream.read(_INDEX_HEAD.size)
    if len(head) < _INDEX_HEAD.size:
        return f"{idx_path} is {len(head)} bytes, shorter than an index header"
    magic, version, _, sequences, documents = _INDEX_HEAD.unpack(head)
    if magic != _INDEX_MAGIC or version != 1:
        return f"{idx_path} has no megatron index header (version 1)"
    needed = _INDEX_HEAD.size + sequences * (4 + 8) + documents * 8
    size = os.path.getsize(idx_path)
    if size < needed:
        return f"{idx_path} is {size} bytes, its header announces {needed} (truncated)"
    return None


def _check_blend(data_path, split: str, num_samples: list) -> tuple[list, list | None, dict]:
    """The blend's (prefixes, weights, train tokens of each prefix), each prefix present and
    readable and every split with a share given at least one of its documents (megatron-core
    0.16.1 loops forever otherwise)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    try:
        shares = parse_and_normalize_split(split)
    except (AssertionError, ZeroDivisionError, ValueError):
        raise DatasetError(
            f"split must be three non-negative shares like '949,50,1', got {split!r}."
        ) from None
    prefixes, weights = parse_blend(data_path)
    train_tokens = {}
    for prefix in prefixes:
        lengths = _document_lengths(prefix)
        n_docs = len(lengths)
        for name, span in zip(
            ("train", "valid", "test"), convert_split_vector_to_split_matrix(shares)
        ):
            if span is None:
                continue
            begin, end = int(round(span[0] * n_docs)), int(round(span[1] * n_docs))
            if begin == end:
                raise DatasetError(
                    f"data.split={split!r} gives the {name} split no document of '{prefix}' "
                    f"({n_docs} documents); give that split a larger share, or 0 to drop it."
                )
            if name == "train":
                train_tokens[prefix] = int(lengths[begin:end].sum())
    if weights is not None and any(
        share > 0 and n is None for share, n in zip(shares, num_samples)
    ):
        raise DatasetError("a weighted blend needs num_samples for every split with a nonzero share.")
    return prefixes, weights, train_tokens


def _warn_short_corpus(train_tokens: dict, seq_length: int, global_batch_size: int | None) -> None:
    """Warn (once per prefix, on the first rank) when a prefix's train split is shorter than
    one sample: every sample then holds the same few tokens over and over (megatron builds
    samples across epochs), so the model learns to repeat them. Not refused: a tiny corpus is
    legitimate for an overfitting check."""
    per_sample = seq_length + 1  # a sample reads one token more than it trains on (labels)
    for prefix, tokens in train_tokens.items():
        if tokens >= per_sample:
            continue
        batch = ""
        if global_batch_size:
            batch = (f", and a global batch of {global_batch_size} samples "
                     f"({global_batch_size * seq_length} tokens) sees them "
                     f"~{global_batch_size * per_sample / tokens:.0f} times")  # fmt: skip
        logger.warning(
            "data.path: the train split of '%s' holds %d tokens, fewer than one sample of %d "
            "(train.seq_length=%d + 1): each sample repeats those tokens ~%.1f times%s, so training "
            "memorizes them. Use a larger corpus, a shorter train.seq_length, or a larger train "
            "share of data.split", prefix, tokens, per_sample, seq_length, per_sample / tokens, batch,
        )  # fmt: skip


def build_gpt_datasets(
    data_path,
    tokenizer,
    *,
    seq_length: int,
    num_samples: Sequence[int | None],
    split: str = "949,50,1",
    seed: int = 1234,
    cache_dir: str | os.PathLike | None = None,
    create_attention_mask: bool = False,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    global_batch_size: int | None = None,
):
    """Build the (train, valid, test) GPT datasets; a split with weight 0 comes back as None.

    Args:
        data_path: dataset prefix(es) written by ``engram-preprocess`` (see `parse_blend`).
        tokenizer: a megatron tokenizer (e.g. `engram_train.data.text_tokenizer.HFTokenizer`).
        seq_length: tokens per sample; each sample reads ``seq_length + 1`` tokens so that
            ``labels`` are ``tokens`` shifted by one.
        num_samples: samples to draw per split, ``(train, valid, test)``; a dataset smaller
            than that is repeated over epochs, each reshuffled. ``None``: one epoch
            (not allowed for weighted blends).
        split: relative document shares of train/valid/test, e.g. ``"949,50,1"``.
        seed: shuffling seed.
        cache_dir: where megatron keeps the document/sample/shuffle index files (reused across
            runs; must be visible to all ranks). Default ``<cache>/dataset_indices``.
        create_attention_mask: add a ``[1, S, S]`` bool ``attention_mask`` (True = masked) to
            each sample. Off by default: megatron's attention builds the causal mask itself.
        reset_position_ids, reset_attention_mask, eod_mask_loss: megatron's document-boundary
            options, off by default.
        global_batch_size: samples per optimizer step, for the warning about a train split
            shorter than one sample (`_warn_short_corpus`).

    Raises `DatasetError` (`DatasetNotFoundError`: no files at a prefix) for a dataset that
    cannot be trained on as given.
    """
    import torch
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    if seq_length <= 0:
        raise DatasetError(f"seq_length must be positive, got {seq_length}.")
    num_samples = list(num_samples)
    if len(num_samples) != 3:
        raise DatasetError(f"num_samples must be (train, valid, test), got {num_samples!r}.")
    prefixes, weights, train_tokens = _check_blend(data_path, split, num_samples)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_rank() == 0:
        _warn_short_corpus(train_tokens, seq_length, global_batch_size)

    # megatron-core < 0.18 cannot build a weighted blend without a process group.
    apply_patches(DATASET_PATCHES)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "dataset_indices"
    ensure_dataset_helpers()

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split=split,
        path_to_cache=str(cache),
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
    )
    first = not distributed or torch.distributed.get_rank() == 0
    return _build_splits(config, num_samples, cache, first)


def _build_splits(config, num_samples: list, cache: Path, first: bool):
    """megatron's blended builder over ``config``; the ``first`` rank (or a lone process) holds
    the cache's lock while it writes the index files, the others read them."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset

    builder = BlendedMegatronDatasetBuilder(GPTDataset, num_samples, lambda: True, config)
    lock = file_lock(cache / ".lock") if first else contextlib.nullcontext()
    tokenizer = config.tokenizer
    with lock, warnings.catch_warnings():
        if getattr(tokenizer, "pad", None) == getattr(tokenizer, "eod", None):
            # Intended: with pad == eod megatron pads partial samples with a sentinel id (and
            # masks it from the loss), so that real end-of-document tokens keep their loss.
            warnings.filterwarnings("ignore", message="The pad token id in the tokenizer collides")
        train, valid, test = builder.build()
    return train, valid, test
