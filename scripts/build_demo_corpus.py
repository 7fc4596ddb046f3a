#!/usr/bin/env python
"""Rebuild the demo corpus, tokenizer and indexed dataset shipped in examples/data/.

Source: Debian's ``r-cran-janeaustenr`` package (version 1.0.0-1, MIT-licensed packaging by
Julia Silge of the Project Gutenberg texts of Jane Austen's novels, which are in the public
domain). The package is an R library: its texts sit in an R lazy-load database
(``data/Rdata.rdb`` + ``.rdx``), which this script reads with a small reader for R's XDR
serialization format, so neither R nor dpkg is needed.

Steps (all deterministic):
  1. fetch the .deb with ``apt-get download`` (or take ``--deb``) and check its SHA-256;
  2. read three novels, unwrap Gutenberg's hard-wrapped lines into paragraphs, cut each novel
     into chapters; one chapter is one document -> ``demo_corpus.jsonl``;
  3. train a byte-level BPE tokenizer (4096 ids, ``<|endoftext|>`` = id 0, used as EOD and pad)
     with the ``tokenizers`` library -> ``tokenizer/tokenizer.json``;
  4. run ``engram-preprocess`` on the JSONL -> ``demo_text_document.{bin,idx}``.

Usage::

    python scripts/build_demo_corpus.py            # writes examples/data/
    python scripts/build_demo_corpus.py --check    # rebuild in a temp dir, compare to examples/data/
"""

from __future__ import annotations

import argparse
import filecmp
import gzip
import hashlib
import io
import json
import lzma
import os
import re
import struct
import subprocess
import sys
import tarfile
import tempfile
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "examples" / "data"

DEB_NAME = "r-cran-janeaustenr"
DEB_VERSION = "1.0.0-1"
DEB_SHA256 = "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"
RDATA = "usr/lib/R/site-library/janeaustenr/data/Rdata"

# (R object name, title); about 2.1 MB of text together.
NOVELS = [
    ("prideprejudice", "Pride and Prejudice"),
    ("emma", "Emma"),
    ("persuasion", "Persuasion"),
]

EOD_TOKEN = "<|endoftext|>"
VOCAB_SIZE = 4096
SHIPPED = [
    "demo_corpus.jsonl",
    "tokenizer/tokenizer.json",
    "demo_text_document.bin",
    "demo_text_document.idx",
]


# --------------------------------------------------------------------------- .deb


def fetch_deb(workdir: Path) -> Path:
    subprocess.run(["apt-get", "download", f"{DEB_NAME}={DEB_VERSION}"], cwd=workdir, check=True)
    (deb,) = workdir.glob(f"{DEB_NAME}_*.deb")
    return deb


def read_deb_members(deb: Path, names: list[str]) -> dict[str, bytes]:
    """Return the files `names` from the data archive of a .deb (an `ar` archive)."""
    blob = deb.read_bytes()
    if hashlib.sha256(blob).hexdigest() != DEB_SHA256:
        raise SystemExit(f"{deb}: SHA-256 differs from {DEB_NAME} {DEB_VERSION}; refusing to build")
    assert blob[:8] == b"!<arch>\n", "not an ar archive"
    pos, data_tar = 8, None
    while pos < len(blob):
        header = blob[pos : pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        body = blob[pos + 60 : pos + 60 + size]
        if name.startswith("data.tar"):
            data_tar = body
        pos += 60 + size + (size & 1)
    assert data_tar is not None, "no data.tar in the .deb"
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data_tar)) as tar:
        for name in names:
            out[name] = tar.extractfile("./" + name).read()
    return out


# --------------------------------------------------------------------------- R serialization


class _RReader:
    """Reader for R's XDR serialization (format 'X', versions 2 and 3), enough for data objects:
    vectors, strings, pairlists, attributes. Values come back as Python lists/str/None."""

    def __init__(self, data: bytes):
        self.data, self.pos, self.refs = data, 0, []

    def _int(self) -> int:
        (v,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return v

    def _len(self) -> int:
        n = self._int()
        if n == -1:
            hi, lo = self._int(), self._int()
            n = (hi << 32) + lo
        return n

    def read(self):
        assert self.data[:2] == b"X\n", "only XDR serialization is supported"
        self.pos = 2
        version = self._int()
        self._int(), self._int()
        if version == 3:
            n = self._int()
            self.pos += n  # native encoding name
        return self._item()

    def _item(self):
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in (254, 253, 252, 251, 250, 242, 241):  # NULL and the special environments
            return None
        if kind == 255:  # reference to an earlier symbol/environment
            idx = flags >> 8 or self._int()
            return self.refs[idx - 1]
        if kind == 1:  # SYMSXP
            sym = self._item()
            self.refs.append(sym)
            return sym
        if kind in (2, 6):  # LISTSXP, LANGSXP: a pairlist -> list of (tag, value)
            attr = self._item() if has_attr else None
            tag = self._item() if has_tag else None
            head = [(tag, self._item())]
            rest = self._item()
            del attr
            return head + (rest or [])
        if kind == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None
            s = self.data[self.pos : self.pos + n].decode("utf-8")
            self.pos += n
            return s
        if kind in (10, 13):  # LGLSXP, INTSXP
            n = self._len()
            vals = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif kind == 14:  # REALSXP
            n = self._len()
            vals = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        elif kind in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            vals = [self._item() for _ in range(self._len())]
        elif kind == 24:  # RAWSXP
            n = self._len()
            vals = self.data[self.pos : self.pos + n]
            self.pos += n
        else:
            raise ValueError(f"unsupported R object type {kind}")
        if has_attr:
            attrs = dict(self._item())
            if "names" in attrs and kind == 19:
                return dict(zip(attrs["names"], vals))
        return vals


def read_lazyload_db(rdx: bytes, rdb: bytes) -> dict[str, object]:
    """Read every variable of an R lazy-load database (.rdx index + .rdb blobs)."""
    index = _RReader(gzip.decompress(rdx)).read()
    out = {}
    for name, (offset, length) in index["variables"].items():
        blob = rdb[offset : offset + length]
        (size,) = struct.unpack(">I", blob[:4])
        compressed = index["compressed"][0]
        if compressed in (True, 1):
            raw = zlib.decompress(blob[4:])
        else:  # 2 = bzip2, 3 = xz, with a one-byte type ('Z', '2', 'X', '0') first
            kind, payload = blob[4:5], blob[5:]
            raw = {b"0": lambda b: b, b"X": lzma.decompress, b"Z": zlib.decompress}[kind](payload)
        assert len(raw) == size
        out[name] = _RReader(raw).read()
    return out


# --------------------------------------------------------------------------- corpus


_CHAPTER = re.compile(r"^chapter\s+([0-9IVXLC]+)\.?\s*$", re.IGNORECASE)


def novel_to_chapters(lines: list[str], title: str) -> list[dict]:
    """Cut a novel (one Gutenberg line per element) into chapters of unwrapped paragraphs.

    Text before the first chapter heading (title page) is dropped; volume headings inside the
    text are dropped too; runs of spaces (two after a full stop, in some texts) become one.
    """
    chapters, paragraphs, current = [], [], []
    started = False

    def flush_paragraph():
        if current:
            paragraphs.append(re.sub(r"\s+", " ", " ".join(current)))
            current.clear()

    def flush_chapter():
        flush_paragraph()
        if started and paragraphs:
            chapters.append(
                {"text": "\n\n".join(paragraphs), "book": title, "chapter": len(chapters) + 1}
            )
        paragraphs.clear()

    for raw in lines:
        line = (raw or "").strip()
        if _CHAPTER.match(line):
            flush_chapter()
            started = True
            continue
        if not started or re.match(r"^(VOLUME|Volume)\s+[IVX0-9]+", line):
            continue
        if line:
            current.append(line)
        else:
            flush_paragraph()
    flush_chapter()
    return chapters


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path), pretty=True)


# --------------------------------------------------------------------------- main


def build(out: Path, deb: Path | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        deb = deb or fetch_deb(Path(tmp))
        files = read_deb_members(deb, [RDATA + ".rdx", RDATA + ".rdb"])
    data = read_lazyload_db(files[RDATA + ".rdx"], files[RDATA + ".rdb"])

    docs = []
    for name, title in NOVELS:
        chapters = novel_to_chapters(data[name], title)
        print(f"{title}: {len(chapters)} chapters")
        docs.extend(chapters)
    corpus = out / "demo_corpus.jsonl"
    with open(corpus, "w", encoding="utf-8", newline="\n") as f:
        for doc in docs:
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")

    tokenizer = out / "tokenizer" / "tokenizer.json"
    train_tokenizer([d["text"] for d in docs], tokenizer)

    subprocess.run(
        [
            sys.executable, "-m", "engram_train.data.preprocess",
            "--input", str(corpus),
            "--json-key", "text",
            "--tokenizer", str(tokenizer),
            "--output-prefix", str(out / "demo"),
            "--no-progress",
        ],
        check=True,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="output folder (default: examples/data)"
    )
    p.add_argument(
        "--deb",
        type=Path,
        help=f"a downloaded {DEB_NAME}_{DEB_VERSION}_all.deb (default: apt-get download)",
    )
    p.add_argument(
        "--check", action="store_true", help="rebuild into a temp dir and compare with --out"
    )
    args = p.parse_args(argv)

    if not args.check:
        build(args.out, args.deb)
        for rel in SHIPPED:
            f = args.out / rel
            print(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {os.path.getsize(f):>9}  {rel}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), args.deb)
        differ = [
            rel
            for rel in SHIPPED
            if not filecmp.cmp(Path(tmp) / rel, args.out / rel, shallow=False)
        ]
    if differ:
        raise SystemExit(f"rebuilt files differ from {args.out}: {differ}")
    print(f"reproduced: {', '.join(SHIPPED)}")


if __name__ == "__main__":
    main()
