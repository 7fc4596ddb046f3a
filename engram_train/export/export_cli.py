"""engram-export's command line (python -m engram_train.export)."""

from __future__ import annotations

import argparse
import re
import sys

from engram_train.errors import EngramError
from engram_train.export.config_source import read_config_file
from engram_train.export.export_errors import ExportError
from engram_train.export.exporter import DEFAULT_SHARD_BYTES, TABLE_DTYPES
from engram_train.export.publish import FORMATS, MARKER, verify_export


def _parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 5GB or 500MB")
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[match.group(2).upper()]
    return int(float(match.group(1)) * scale)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engram-export",
        description="Export a trained Engram checkpoint for inference: Engram layers under the "
                    "DeepSeek reference's names, hash constants, tokenizer and backbone "
                    "(format: docs/export.md).",
    )
    parser.add_argument("--load", metavar="CKPT_DIR",
                        help="checkpoint.save folder of the run (or one iter_XXXXXXX folder)")
    parser.add_argument("--out", metavar="DIR", help="export folder to create")
    parser.add_argument("--check", metavar="DIR", default=None,
                        help=f"export nothing: check an earlier export's files against the sizes "
                             f"and SHA-256 its {MARKER} recorded, naming each changed, missing "
                             "or added file")
    parser.add_argument("--iteration", type=int, default=None,
                        help="iteration to export (default: the latest complete one)")
    parser.add_argument("--config", default=None, metavar="YAML",
                        help="the run's resolved config.yaml (engram-train writes it into "
                             "experiment.exp_dir); found next to CKPT_DIR when omitted")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="tokenizer.json (or its folder) if the run config's "
                             "engram_tokenizer_name_or_path does not resolve from here")
    parser.add_argument("--table-dtype", choices=sorted(TABLE_DTYPES), default=None,
                        help="store the Engram tables in this dtype (default: as trained)")
    parser.add_argument("--hf-layout", choices=("released", "bf16"), default=None,
                        help="--format hf of a DeepSeek-V4.1 checkpoint: the release's "
                             "FP8/FP4 layout with E8M0 scales (released, the default) or "
                             "unquantized bf16 (float32 where the release keeps it)")
    parser.add_argument("--max-shard-size", type=_parse_size, default=DEFAULT_SHARD_BYTES,
                        metavar="SIZE", help="largest backbone file, e.g. 5GB (default)")
    parser.add_argument("--format", choices=list(FORMATS), default="engram",
                        help="; ".join(f"{f.name}: {f.description}" for f in FORMATS.values())
                        + " (default: engram)")
    parser.add_argument("--force", action="store_true",
                        help="replace an earlier export at --out (never anything else)")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip the SHA-256 of every checkpoint file against its manifest "
                             "(sizes are still compared); for very large checkpoints")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.check is not None:
        if args.load or args.out:
            parser.error("--check takes no --load or --out")
        try:
            count = verify_export(args.check)
        except EngramError as err:
            raise SystemExit(f"engram-export: error: {err}") from None
        print(f"engram-export: {args.check}: {count} files match the SHA-256 recorded in its "
              f"{MARKER}", file=sys.stderr)
        return
    if not (args.load and args.out):
        parser.error("the following arguments are required: --load, --out (or --check DIR)")
    fmt = FORMATS[args.format]
    options = {"table_dtype": args.table_dtype, "hf_layout": args.hf_layout}
    given = [name for name, value in options.items() if value is not None and name not in fmt.options]
    try:
        if args.config is not None:
            read_config_file(args.config)  # before the checkpoint is read, for every format
        if given:
            raise ExportError(f"--{given[0].replace('_', '-')} does not apply to --format {fmt.name}; "
                              "drop it")  # fmt: skip
        fmt.load()(
            args.load, args.out, iteration=args.iteration, config=args.config,
            tokenizer=args.tokenizer, force=args.force, max_shard_bytes=args.max_shard_size,
            verify=args.verify, **{name: options[name] for name in fmt.options},
        )
    except EngramError as err:
        raise SystemExit(f"engram-export: error: {err}") from None


if __name__ == "__main__":
    main()
