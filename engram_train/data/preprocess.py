"""engram-preprocess: text or JSONL documents -> a megatron indexed dataset (.bin/.idx).

The output is written with megatron-core's own ``IndexedDatasetBuilder``, so megatron's
``IndexedDataset``/``GPTDataset`` (and Megatron-LM's tools) read it unchanged. As in
Megatron-LM's ``tools/preprocess_data.py``, the output files are
``<output-prefix>_<json-key>_document.{bin,idx}``, every document ends with the tokenizer's EOD
id, empty documents are skipped, and the token dtype is uint16 when the vocabulary fits, else
int32.

Documents:
  * ``.jsonl`` / ``.json`` files: one JSON object per line, the text under ``--json-key``.
  * other files (plain text): by ``--text-doc`` — ``paragraph`` (default): blocks separated by
    one or more blank lines; ``line``: every non-empty line; ``file``: the whole file.
  * a ``.gz`` suffix on any input is decompressed on the fly.

Failure is safe: the output is written to temporary files next to it and renamed into place
only when every input was read, so an existing ``.bin``/``.idx`` pair survives a failed run
unchanged. An input that is empty, a line that is not UTF-8, not JSON or lacks the JSON key
stops the run naming the file and line; ``--skip-bad-lines`` skips such lines instead and
reports how many (and which) were skipped.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from engram_train.errors import EngramError, InputError
from engram_train.output_paths import probe_write

TEXT_DOC_MODES = ("paragraph", "line", "file")
BATCH_DOCS = 512


class PreprocessError(EngramError, ValueError):
    """Bad input; the message names the file (and line) and the fix."""


class BadLines:
    """Lines skipped under ``--skip-bad-lines``: a count and the first few places."""

    SHOWN = 5

    def __init__(self) -> None:
        self.count = 0
        self.first: list[str] = []

    def add(self, where: str) -> None:
        self.count += 1
        if len(self.first) < self.SHOWN:
            self.first.append(where)

    def __str__(self) -> str:
        more = f", ... ({self.count - len(self.first)} more)" if self.count > len(self.first) else ""
        return f"{self.count} bad lines skipped: " + "; ".join(self.first) + more


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _undecodable(path: Path, lineno: int, e: UnicodeDecodeError) -> str:
    return f"{path}:{lineno}: not valid UTF-8 (byte 0x{e.object[e.start]:02x} at column {e.start + 1})"


def _is_jsonl(path: Path, input_format: str) -> bool:
    if input_format != "auto":
        return input_format == "jsonl"
    suffixes = path.suffixes[-2:] if path.suffix == ".gz" else path.suffixes[-1:]
    return bool(suffixes) and suffixes[0] in (".jsonl", ".json")


def iter_documents(
    path: str | os.PathLike,
    *,
    input_format: str = "auto",
    json_key: str = "text",
    text_doc: str = "paragraph",
    on_bytes=None,
    bad_lines: BadLines | None = None,
) -> Iterator[str]:
    """Yield the documents of one input file (see the module docstring for the rules).

    `on_bytes(n)` is called with the number of bytes consumed, for progress bars. A bad line
    raises `PreprocessError` naming the file and line, or with `bad_lines` is counted there and
    skipped.
    """
    path = Path(path)
    if text_doc not in TEXT_DOC_MODES:
        raise PreprocessError(f"text_doc must be one of {TEXT_DOC_MODES}, got {text_doc!r}")
    tick = on_bytes or (lambda n: None)
    hint = " (or pass --skip-bad-lines to skip such lines)"

    def bad(where: str) -> None:
        if bad_lines is None:
            raise PreprocessError(where + hint)
        bad_lines.add(where)

    def lines():
        with _open_binary(path) as f:
            for lineno, raw in enumerate(f, 1):
                tick(len(raw))
                try:
                    yield lineno, raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    bad(_undecodable(path, lineno, e))

    if _is_jsonl(path, input_format):
        for lineno, line in lines():
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                bad(f"{path}:{lineno}: not valid JSON ({e})")
                continue
            if not isinstance(obj, dict) or json_key not in obj:
                bad(f"{path}:{lineno}: no {json_key!r} field (set --json-key)")
                continue
            text = obj[json_key]
            if not isinstance(text, str):
                bad(f"{path}:{lineno}: field {json_key!r} is not a string")
                continue
            yield text
    elif text_doc == "file":
        with _open_binary(path) as f:
            data = f.read()
        tick(len(data))
        try:
            yield data.decode("utf-8")
        except UnicodeDecodeError as e:
            lineno = data.count(b"\n", 0, e.start) + 1
            column = e.start - (data.rfind(b"\n", 0, e.start) + 1)
            bad(f"{path}:{lineno}: not valid UTF-8 (byte 0x{data[e.start]:02x} at column {column + 1})")
    elif text_doc == "line":
        for _, line in lines():
            if line.strip():
                yield line.rstrip("\n")
    else:
        block: list[str] = []
        for _, line in lines():
            if line.strip():
                block.append(line)
            elif block:
                yield "".join(block).rstrip("\n")
                block = []
        if block:
            yield "".join(block).rstrip("\n")


def _read_documents(paths: list[Path], flush, documents_so_far, progress: bool, bad_lines,
                    options: dict) -> None:
    """Every non-blank document of ``paths`` to ``flush`` in batches, with a progress bar; a
    file that yields no document is refused (``documents_so_far()`` counts what was kept)."""
    from tqdm import tqdm

    # Progress counts decompressed bytes, so a total is known only without compressed inputs.
    total = None if any(p.suffix == ".gz" for p in paths) else sum(p.stat().st_size for p in paths)
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", disable=not progress) as bar:
        for p in paths:
            batch: list[str] = []
            docs_before = documents_so_far()
            for doc in iter_documents(p, on_bytes=bar.update, bad_lines=bad_lines, **options):
                if doc.strip():
                    batch.append(doc)
                if len(batch) >= BATCH_DOCS:
                    flush(batch)
                    batch = []
            flush(batch)
            if documents_so_far() == docs_before:
                skipped = " or only skipped lines" if bad_lines is not None and bad_lines.count else ""
                raise PreprocessError(
                    f"{p}: no documents (the file is empty, or holds only blank lines{skipped}): "
                    "remove it from --input"
                )


def preprocess(
    inputs: list[str | os.PathLike],
    output_prefix: str | os.PathLike,
    tokenizer,
    *,
    input_format: str = "auto",
    json_key: str = "text",
    text_doc: str = "paragraph",
    append_eod: bool = True,
    progress: bool = True,
    skip_bad_lines: bool = False,
) -> dict:
    """Tokenize `inputs` into ``<output_prefix>_<json_key>_document.{bin,idx}``.

    Returns a summary: ``prefix`` (the dataset prefix to give training), ``documents``,
    ``tokens`` (EOD included), ``bad_lines`` (a `BadLines`, with ``skip_bad_lines``).
    Raises `PreprocessError` for an empty input or a bad line (see the module docstring);
    the output files are then left as they were.
    """
    from megatron.core.datasets.indexed_dataset import (
        DType,
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    paths = [Path(p) for p in inputs]
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"input file not found: {p}")
    prefix = f"{output_prefix}_{json_key}_document"
    try:  # a folder it cannot write in is refused before the inputs are read
        probe_write(Path(prefix).parent)
    except OSError as e:
        raise InputError(f"--output-prefix {output_prefix}: cannot write in {Path(prefix).parent} "
                         f"({e.strerror or e}); choose a folder this process can write to") from None
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    bin_path, idx_path = Path(get_bin_path(prefix)), Path(get_idx_path(prefix))
    tmp_bin = bin_path.with_name(f"{bin_path.name}.tmp-{os.getpid()}")
    tmp_idx = idx_path.with_name(f"{idx_path.name}.tmp-{os.getpid()}")
    builder = IndexedDatasetBuilder(str(tmp_bin), dtype=dtype)
    bad_lines = BadLines() if skip_bad_lines else None
    encode = getattr(tokenizer, "tokenize_batch", None) or (
        lambda texts: [tokenizer.tokenize(t) for t in texts]
    )

    n_docs = n_tokens = 0

    def flush(batch: list[str]) -> None:
        nonlocal n_docs, n_tokens
        for ids in encode(batch):
            if append_eod:
                ids = list(ids) + [tokenizer.eod]
            if not ids:
                continue
            builder.add_document(np.asarray(ids, dtype=dtype), [len(ids)])
            n_docs += 1
            n_tokens += len(ids)

    try:
        _read_documents(paths, flush, lambda: n_docs, progress, bad_lines,
                        dict(input_format=input_format, json_key=json_key, text_doc=text_doc))
        builder.finalize(str(tmp_idx))
        # Replace the pair: the old .idx goes first, so an interruption leaves a .bin without
        # an .idx (refused by training) rather than a new .bin with the old .idx.
        idx_path.unlink(missing_ok=True)
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
    except BaseException:
        builder.data_file.close()
        tmp_bin.unlink(missing_ok=True)
        tmp_idx.unlink(missing_ok=True)
        raise
    return {"prefix": prefix, "documents": n_docs, "tokens": n_tokens, "dtype": dtype.__name__,
            "bad_lines": bad_lines}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="engram-preprocess",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "example:\n"
            "  engram-preprocess --input corpus.jsonl --json-key text \\\n"
            "      --tokenizer examples/data/tokenizer --output-prefix data/corpus\n"
            "  -> data/corpus_text_document.bin/.idx; train with data.path=data/corpus_text_document"
        ),
    )
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="FILE",
        help="input files, processed in the given order (.txt, .jsonl, optionally .gz)",
    )
    p.add_argument(
        "--output-prefix",
        required=True,
        help="output path prefix; files are <prefix>_<json-key>_document.{bin,idx}",
    )
    p.add_argument(
        "--tokenizer", required=True, help="a Hugging Face tokenizer.json or the folder holding it"
    )
    p.add_argument(
        "--input-format",
        choices=("auto", "text", "jsonl"),
        default="auto",
        help="auto (default): .jsonl/.json files are JSONL, anything else plain text",
    )
    p.add_argument(
        "--json-key",
        default="text",
        help="JSONL field holding the document text; also names the output (default: text)",
    )
    p.add_argument(
        "--text-doc",
        choices=TEXT_DOC_MODES,
        default="paragraph",
        help="plain text only: what one document is; paragraph (default) = a block "
        "ended by a blank line, line = one line, file = the whole file",
    )
    p.add_argument(
        "--eod-token",
        help="end-of-document token (default: the tokenizer's EOS, e.g. <|endoftext|>)",
    )
    p.add_argument(
        "--no-append-eod",
        dest="append_eod",
        action="store_false",
        help="do not append the EOD id after each document",
    )
    p.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip lines that are not UTF-8, not JSON or lack --json-key (counted and reported) "
        "instead of stopping at the first",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed")
    from engram_train.data.text_tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(args.tokenizer, eod_token=args.eod_token, field="--tokenizer")
        summary = preprocess(
            args.input,
            args.output_prefix,
            tokenizer,
            input_format=args.input_format,
            json_key=args.json_key,
            text_doc=args.text_doc,
            append_eod=args.append_eod,
            progress=args.progress,
            skip_bad_lines=args.skip_bad_lines,
        )
    except (EngramError, FileNotFoundError) as e:
        print(f"engram-preprocess: {str(e).rstrip('.')}; nothing was written", file=sys.stderr)
        return 1
    print(
        f"wrote {summary['prefix']}.bin/.idx: {summary['documents']} documents, "
        f"{summary['tokens']} tokens ({summary['dtype']}); tokenizer {tokenizer!r}",
        file=sys.stderr,
    )
    if summary["bad_lines"] is not None and summary["bad_lines"].count:
        print(f"engram-preprocess: {summary['bad_lines']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
