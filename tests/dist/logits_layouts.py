"""engram-logits' own path at several layouts in one launch, and an independent forward.

Four ranks. First every rank builds the whole model (tensor, pipeline, expert and Engram
embedding-parallel sizes 1), loads the checkpoint and calls it directly on the whole batch: the
model hashes the ids itself (``EngramGPTModel`` without ``engram_hash_ids``), positions restart
after each end-of-document id by a loop written here, no pipeline schedule; rank 0 writes
``independent.safetensors``. Then `engram_train.inference.logits.run` (the command without its
exit handling) runs at each layout of --layouts (``name:key=value,key=value;...``), writing
``<name>.safetensors``.

Then, for each model of --models (JSON: ``{name: {"preset": model preset replacing the run
config's model section, or absent, "model": [key=value, ...] overrides, "layout": [key=value,
...] the command's layout}}``), every rank builds it at one process per model, initialised from
a seed, and saves it as a model-only checkpoint carrying its run config, as ``engram-import-hf``
saves one (``<name>/ckpt``); its direct forward goes to ``<name>/independent.safetensors`` (a
model that does not hash by itself, DeepSeek-V4.1's, gets the hash ids of its mapping) and the
command's to ``<name>/command.safetensors``.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
import torch.distributed as dist
from common import parse_args, write_result
from omegaconf import OmegaConf
from safetensors.torch import save_file

from engram_train.checkpoint import load_checkpoint, save_checkpoint
from engram_train.engram.variant import build_hash_mapping
from engram_train.export.checkpoint_reader import DistCheckpointReader
from engram_train.inference.logits import build_parser, read_ids, run
from engram_train.models.builder import build_model
from engram_train.models.presets import CONF_DIR
from engram_train.runtime import ParallelSizes, initialize_distributed
from engram_train.training.run_config import build_transformer_config
from engram_train.training.run_identity import run_identity

EOD = 0  # the demo tokenizer's end-of-document id


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


def direct_forward(cfg, config, chunk, ids: torch.Tensor, out: Path) -> None:
    """The whole batch through the model at once; the model hashes the ids itself."""
    chunk.eval()
    positions = (reset_positions(ids, EOD) if cfg.data.reset_position_ids
                 else torch.arange(ids.shape[1]).expand_as(ids))
    kwargs = {}
    if getattr(config, "model_family", None) == "deepseek_v41" and config.use_engram:
        kwargs["engram_hash_ids"] = torch.as_tensor(build_hash_mapping(config).hash_block(ids))
    with torch.no_grad():
        logits = chunk(ids, positions.contiguous(), None, **kwargs)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file({"logits": logits.float().contiguous()}, str(out / "independent.safetensors"))


def independent(ckpt: str, config: str, ids: torch.Tensor, out: Path) -> int:
    """The trained checkpoint's direct forward; returns its vocabulary rows."""
    cfg = OmegaConf.load(config)
    config = build_transformer_config(cfg)  # the trained layout is one process per model
    initialize_distributed(ParallelSizes(), seed=7)
    reader = DistCheckpointReader(next(Path(ckpt).glob("iter_*")))
    vocab = reader.tensors["embedding.word_embeddings.weight"].shape[0]
    model = build_model(config, vocab, cfg.train.seq_length, wrap_with_ddp=False)
    load_checkpoint(ckpt, model, strict=False)  # optimizer state left out
    direct_forward(cfg, config, model[0], ids, out)
    return vocab


def other_model(name: str, spec: dict, config: str, vocab: int, ids: torch.Tensor,
                out: Path) -> str:
    """A seeded model of the run config as ``spec`` changes it, saved with its run config
    (module docstring); returns the checkpoint folder."""
    cfg = OmegaConf.load(config)
    if spec.get("preset"):
        cfg.model = OmegaConf.load(Path(CONF_DIR) / "model" / f"{spec['preset']}.yaml")
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(spec.get("model", [])))
    config = build_transformer_config(cfg)
    initialize_distributed(ParallelSizes(), seed=11)
    model = build_model(config, vocab, cfg.train.seq_length, wrap_with_ddp=False)
    mapping = build_hash_mapping(config) if config.use_engram else None
    ckpt = out / name / "ckpt"
    save_checkpoint(ckpt, 0, model, None,
                    extra={"run_config": OmegaConf.to_container(cfg, resolve=True)},
                    run_identity=run_identity(config, vocab, mapping))
    direct_forward(cfg, config, model[0], ids, out / name)
    return str(ckpt)


def command(ckpt: str, ids: str, out: Path, overrides: list[str]):
    argv = ["--load", ckpt, "--ids", ids, "--out", str(out), *overrides]
    logits = run(build_parser().parse_args(argv), log=lambda _: None)
    return None if logits is None else list(logits.shape)


def main():
    args = parse_args({"--ckpt": dict(required=True), "--config": dict(required=True),
                       "--ids": dict(required=True), "--layouts": dict(required=True),
                       "--models": dict(default="{}")})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ids = read_ids(args.ids)
    vocab = independent(args.ckpt, args.config, ids, out)
    shapes = {}
    for layout in args.layouts.split(";"):
        name, overrides = layout.split(":")
        shapes[name] = command(args.ckpt, args.ids, out / f"{name}.safetensors",
                               overrides.split(","))
    for name, spec in json.loads(args.models).items():
        ckpt = other_model(name, spec, args.config, vocab, ids, out)
        shapes[name] = command(ckpt, args.ids, out / name / "command.safetensors",
                               spec.get("layout", []))
    write_result(args.out, {"shapes": shapes})


if __name__ == "__main__":
    main()
