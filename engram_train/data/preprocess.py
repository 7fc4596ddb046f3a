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

TEXT_DOC_MODES = ("paragraph", "line", "file")
BATCH_DOCS = 512


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


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
) -> Iterator[str]:
    """Yield the documents of one input file (see the module docstring for the rules).

    `on_bytes(n)` is called with the number of (decoded) bytes consumed, for progress bars.
    """
    path = Path(path)
    if text_doc not in TEXT_DOC_MODES:
        raise ValueError(f"text_doc must be one of {TEXT_DOC_MODES}, got {text_doc!r}")
    tick = on_bytes or (lambda n: None)
    with _open_text(path) as f:
        if _is_jsonl(path, input_format):
            for lineno, line in enumerate(f, 1):
                tick(len(line.encode("utf-8")))
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
                if not isinstance(obj, dict) or json_key not in obj:
                    raise ValueError(f"{path}:{lineno}: no {json_key!r} field (set --json-key)")
                text = obj[json_key]
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{lineno}: field {json_key!r} is not a string")
                yield text
        elif text_doc == "file":
            text = f.read()
            tick(len(text.encode("utf-8")))
            yield text
        elif text_doc == "line":
            for line in f:
                tick(len(line.encode("utf-8")))
                if line.strip():
                    yield line.rstrip("\n")
        else:
            block: list[str] = []
            for line in f:
                tick(len(line.encode("utf-8")))
                if line.strip():
                    block.append(line)
                elif block:
                    yield "".join(block).rstrip("\n")
                    block = []
            if block:
                yield "".join(block).rstrip("\n")


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
) -> dict:
    """Tokenize `inputs` into ``<output_prefix>_<json_key>_document.{bin,idx}``.

    Returns a summary: ``prefix`` (the dataset prefix to give training), ``documents``,
    ``tokens`` (EOD included).
    """
    from megatron.core.datasets.indexed_dataset import (
        DType,
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )
    from tqdm import tqdm

    paths = [Path(p) for p in inputs]
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"input file not found: {p}")
    prefix = f"{output_prefix}_{json_key}_document"
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
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

    # Progress counts decoded bytes, so a total is known only without compressed inputs.
    total = None if any(p.suffix == ".gz" for p in paths) else sum(p.stat().st_size for p in paths)
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", disable=not progress) as bar:
        for p in paths:
            batch: list[str] = []
            for doc in iter_documents(
                p, input_format=input_format, json_key=json_key, text_doc=text_doc,
                on_bytes=bar.update,
            ):  # fmt: skip
                if doc.strip():
                    batch.append(doc)
                if len(batch) >= BATCH_DOCS:
                    flush(batch)
                    batch = []
            flush(batch)
    builder.finalize(get_idx_path(prefix))
    return {"prefix": prefix, "documents": n_docs, "tokens": n_tokens, "dtype": dtype.__name__}


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
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed")
    from engram_train.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer, eod_token=args.eod_token)
    summary = preprocess(
        args.input,
        args.output_prefix,
        tokenizer,
        input_format=args.input_format,
        json_key=args.json_key,
        text_doc=args.text_doc,
        append_eod=args.append_eod,
        progress=args.progress,
    )
    print(
        f"wrote {summary['prefix']}.bin/.idx: {summary['documents']} documents, "
        f"{summary['tokens']} tokens ({summary['dtype']}); tokenizer {tokenizer!r}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
