#!/usr/bin/env python
"""Build a Python-code corpus (about 10M tokens) for engram-sweep from pinned PyPI wheels.

Source: the Python files of three pure-Python wheels, fetched with ``pip download`` (so only
the package registry is needed) and checked by SHA-256 before anything is read: sympy 1.13.3,
Django 5.1.4, networkx 3.4.2 (BSD-licensed). One ``.py`` file is one document.

Steps (all deterministic):
  1. ``pip download --no-deps`` each pinned wheel (or take them from ``--wheels``) and refuse
     any whose SHA-256 differs;
  2. split by file: a file is held out for validation when the SHA-256 of its
     ``<wheel>/<path>`` name falls in the first ``--valid-percent`` of the hash range, so the
     split never depends on the order files are read in and no file is in both;
  3. train a byte-level BPE tokenizer (4,096 ids, ``<|endoftext|>`` = id 0) on the train files
     only -> ``tokenizer/tokenizer.json``;
  4. write the train files, then the validation files, as one JSONL and run
     ``engram-preprocess`` -> ``code_text_document.{bin,idx}``; ``corpus.json`` records the
     split (``"<train files>,<validation files>,0"``: megatron cuts splits by document, so the
     validation split is exactly the held-out files), the token counts and the wheels.

Usage::

    python scripts/build_code_corpus.py                    # writes corpora/code/ (git-ignored)
    engram-sweep --corpus corpora/code ...                 # reads corpus.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "corpora" / "code"

# (requirement, wheel file, SHA-256 of the wheel)
WHEELS = [
    ("sympy==1.13.3", "sympy-1.13.3-py3-none-any.whl",
     "54612cf55a62755ee71824ce692986f23c88ffa77207b30c1368eda4a7060f73"),
    ("django==5.1.4", "Django-5.1.4-py3-none-any.whl",
     "236e023f021f5ce7dee5779de7b286565fdea5f4ab86bae5338e3f7b69896cf0"),
    ("networkx==3.4.2", "networkx-3.4.2-py3-none-any.whl",
     "df5d4365b724cf81b8c6a7312509d0c22386097011ad1abe274afd5e9d3bbc5f"),
]
EOD_TOKEN = "<|endoftext|>"
VOCAB_SIZE = 4096
PREFIX = "code"
DOCUMENTS = f"{PREFIX}_text_document"


class CorpusError(SystemExit):
    """A build that must not go on (a wheel that is not the pinned one); exits non-zero."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheels(wheels: list[tuple[str, str, str]], folder: Path) -> list[Path]:
    """The pinned wheels in `folder` (downloaded with pip when missing), each checked."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for requirement, filename, digest in wheels:
        path = folder / filename
        if not path.is_file():
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                            "--only-binary=:all:", "-d", str(folder), requirement], check=True)
        verify_wheel(path, digest)
        paths.append(path)
    return paths


def verify_wheel(path: Path, digest: str) -> None:
    if not path.is_file():
        raise CorpusError(f"{path}: missing; pip download did not produce this pinned wheel")
    got = sha256(path)
    if got != digest:
        raise CorpusError(
            f"{path.name}: SHA-256 {got} differs from the pinned {digest}; refusing to build "
            "(the registry served another file, or the download is damaged: delete it and rerun)")


def read_sources(wheel: Path) -> list[tuple[str, str]]:
    """(`<wheel name>/<path>`, text) of every non-empty UTF-8 .py file, in archive order."""
    name = wheel.name.split("-")[0].lower()
    docs = []
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if not info.filename.endswith(".py"):
                continue
            try:
                text = z.read(info).decode("utf-8")
            except UnicodeDecodeError:
                continue
            if text.strip():
                docs.append((f"{name}/{info.filename}", text))
    return docs


def is_validation(file_name: str, valid_percent: float) -> bool:
    """Held out when the name's hash falls in the first `valid_percent` of the hash range."""
    h = int.from_bytes(hashlib.sha256(file_name.encode()).digest()[:8], "big")
    return h < valid_percent / 100 * 2**64


def split_files(docs: list[tuple[str, str]], valid_percent: float):
    """(train, valid), each sorted by name: the same files whatever order they came in."""
    docs = sorted(docs)
    train = [d for d in docs if not is_validation(d[0], valid_percent)]
    valid = [d for d in docs if is_validation(d[0], valid_percent)]
    if not train or not valid:
        raise CorpusError(f"--valid-percent {valid_percent} leaves an empty split "
                          f"({len(train)} train, {len(valid)} validation files)")
    return train, valid


def train_tokenizer(texts: list[str], path: Path, vocab_size: int = VOCAB_SIZE) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path), pretty=True)


def document_lengths(prefix: Path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    import numpy as np

    dataset = IndexedDataset(str(prefix))
    return np.array(dataset.sequence_lengths, dtype=np.int64)


def build(out: Path, wheels_dir: Path | None, valid_percent: float,
          wheels: list[tuple[str, str, str]] = WHEELS, vocab_size: int = VOCAB_SIZE) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        paths = fetch_wheels(wheels, wheels_dir or Path(tmp))
        docs = [d for p in paths for d in read_sources(p)]
    train, valid = split_files(docs, valid_percent)
    corpus = out / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8", newline="\n") as f:
        for name, text in train + valid:
            f.write(json.dumps({"text": text, "file": name}, ensure_ascii=False) + "\n")
    train_tokenizer([t for _, t in train], out / "tokenizer" / "tokenizer.json", vocab_size)
    subprocess.run([sys.executable, "-m", "engram_train.data.preprocess", "--input", str(corpus),
                    "--json-key", "text", "--tokenizer", str(out / "tokenizer"),
                    "--output-prefix", str(out / PREFIX), "--no-progress"], check=True)
    lengths = document_lengths(out / DOCUMENTS)
    if len(lengths) != len(train) + len(valid):
        raise CorpusError(f"{len(lengths)} documents written for {len(train) + len(valid)} "
                          "files: the split by file would not hold")
    meta = {
        "prefix": DOCUMENTS, "tokenizer": "tokenizer",
        "split": f"{len(train)},{len(valid)},0",
        "files": {"train": len(train), "valid": len(valid)},
        "tokens": {"train": int(lengths[:len(train)].sum()),
                   "valid": int(lengths[len(train):].sum())},
        "valid_percent": valid_percent,
        "wheels": [{"requirement": r, "file": f, "sha256": s} for r, f, s in wheels],
        "valid_files": [name for name, _ in valid],
    }
    (out / "corpus.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="output folder (default: corpora/code, git-ignored)")
    p.add_argument("--wheels", type=Path, default=None,
                   help="folder holding (or receiving) the pinned wheels (default: a temp dir)")
    p.add_argument("--valid-percent", type=float, default=1.0,
                   help="share of files held out for validation (default 1)")
    args = p.parse_args(argv)
    meta = build(args.out, args.wheels, args.valid_percent)
    print(json.dumps({k: meta[k] for k in ("split", "files", "tokens")}))


if __name__ == "__main__":
    main()
