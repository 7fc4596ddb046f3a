"""engram-logits' own path at several layouts in one launch, and an independent forward.

Four ranks. First every rank builds the whole model (tensor, pipeline, expert and Engram
embedding-parallel sizes 1), loads the checkpoint and calls it directly on the whole batch: the
model hashes the ids itself (``EngramGPTModel`` without ``engram_hash_ids``), positions restart
after each end-of-document id by a loop written here, no pipeline schedule; rank 0 writes
``independent.safetensors``. Then `engram_train.inference.logits.run` (the command without its
exit handling) runs at each layout of --layouts (``name:key=value,key=value;...``), writing
``<name>.safetensors``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
import torch.distributed as dist
from common import parse_args, write_result
from omegaconf import OmegaConf
from safetensors.torch import save_file

from engram_train.checkpoint import load_checkpoint
from engram_train.export.checkpoint_reader import DistCheckpointReader
from engram_train.inference.logits import build_parser, read_ids, run
from engram_train.models.builder import build_model
from engram_train.runtime import ParallelSizes, initialize_distributed
from engram_train.training.run_config import build_transformer_config


def reset_positions(ids: torch.Tensor, eod: int) -> torch.Tensor:
    """Positions counted from 0 again after every ``eod`` (megatron's reset_position_ids)."""
    positions = torch.zeros_like(ids)
    for row in range(ids.shape[0]):
        start = 0
        for t in range(ids.shape[1]):
            positions[row, t] = t - start
            if int(ids[row, t]) == eod:
                start = t + 1
    return positions


def independent(ckpt: str, config: str, ids: torch.Tensor, out: Path) -> None:
    cfg = OmegaConf.load(config)
    config = build_transformer_config(cfg)  # the trained layout is one process per model
    initialize_distributed(ParallelSizes(), seed=7)
    reader = DistCheckpointReader(next(Path(ckpt).glob("iter_*")))
    vocab = reader.tensors["embedding.word_embeddings.weight"].shape[0]
    model = build_model(config, vocab, cfg.train.seq_length, wrap_with_ddp=False)
    load_checkpoint(ckpt, model, strict=False)  # optimizer state left out
    chunk = model[0]
    chunk.eval()
    positions = (reset_positions(ids, int(config.engram_eos_id)) if cfg.data.reset_position_ids
                 else torch.arange(ids.shape[1]).expand_as(ids))
    with torch.no_grad():
        logits = chunk(ids, positions.contiguous(), None)
    if dist.get_rank() == 0:
        save_file({"logits": logits.float().contiguous()}, str(out / "independent.safetensors"))


def main():
    args = parse_args({"--ckpt": dict(required=True), "--config": dict(required=True),
                       "--ids": dict(required=True), "--layouts": dict(required=True)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    independent(args.ckpt, args.config, read_ids(args.ids), out)
    shapes = {}
    for layout in args.layouts.split(";"):
        name, overrides = layout.split(":")
        argv = ["--load", args.ckpt, "--ids", args.ids, "--out", str(out / f"{name}.safetensors"),
                *overrides.split(",")]
        logits = run(build_parser().parse_args(argv), log=lambda _: None)
        shapes[name] = None if logits is None else list(logits.shape)
    write_result(args.out, {"shapes": shapes})


if __name__ == "__main__":
    main()
