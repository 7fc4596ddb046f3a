"""engram-logits of one DeepSeek-V4.1 checkpoint at several layouts and row lengths, in one
launch of four ranks: `engram_train.inference.logits.run` (the command without its exit
handling) for every layout of --layouts (``name:key=value,...;...``; an empty override list is
one process per model, the other ranks data-parallel replicas) and every ids file of --ids
(``length:path,...``), written to ``<name>_<length>.safetensors``. Under tensor parallelism the
command pads a row to a multiple of the tensor-parallel size and marks the extension as
padding (``padding_mask``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import parse_args, write_result

from engram_train.inference.logits import build_parser, run


def main():
    args = parse_args({"--ckpt": dict(required=True), "--ids": dict(required=True),
                       "--layouts": dict(required=True)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = {}
    for layout in args.layouts.split(";"):
        name, overrides = layout.split(":")
        for item in args.ids.split(","):
            length, path = item.split(":", 1)
            argv = ["--load", args.ckpt, "--ids", path, "--out",
                    str(out / f"{name}_{length}.safetensors"),
                    *[o for o in overrides.split(",") if o]]
            logits = run(build_parser().parse_args(argv), log=lambda _: None)
            shapes[f"{name}_{length}"] = None if logits is None else list(logits.shape)
    write_result(args.out, {"shapes": shapes})


if __name__ == "__main__":
    main()
