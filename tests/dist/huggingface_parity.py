"""The megatron side of tests/test_huggingface.py, on one process.

Export: for each backbone of ``CASES`` (and the tiny preset with Engram, on one residual stream
and on mHC's four) a model with every
weight off its init is saved by the trainer's checkpoint save, exported with
``engram-export --format hf`` into ``<out>/<case>/hf``, and its logits on fixed ids (and, with
Engram, greedy decoding by full forward passes) are written to ``<out>/<case>/megatron.pt``.

Import (``--imported CKPT``, written by engram-import-hf): the checkpoint is loaded by the
trainer's load path (model, optimizer, ``load_engram=false``) into the backbone alone and into
the backbone with Engram (value projection at zero, and at its normal init), and each one's
loss on the batch of ``--batch`` is written to ``<out>/import_losses.json``; so is the loss of
``--imported-pp2`` (the same folder imported on two pipeline stages), backbone alone, and of
``--imported-tp2ep2`` (imported at TP2 x EP2) with Engram added. The imports hold weights
only: the trainer's load starts the optimizer afresh.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
from common import parse_args, write_result
from huggingface_models import (
    CASES,
    VOCAB,
    megatron_greedy,
    megatron_logits,
    megatron_loss,
    perturb,
    run_config,
    save_config,
)
from omegaconf import OmegaConf, open_dict

from engram_train.checkpoint import load_checkpoint, save_checkpoint
from engram_train.export.hf_export import export_hf
from engram_train.models.builder import build_model
from engram_train.runtime import ParallelSizes, initialize_distributed
from engram_train.training.run_config import build_transformer_config


def export_case(out: Path, name: str, overrides: list[str], use_engram: bool) -> None:
    root = out / name
    cfg = run_config(overrides, use_engram)
    model = build_model(build_transformer_config(cfg), VOCAB, 48, wrap_with_ddp=False)
    chunk = model[0]
    perturb(chunk)
    save_checkpoint(root / "ckpt", 1, model)
    export_hf(root / "ckpt", root / "hf", config=save_config(cfg, root / "config.yaml"),
              max_shard_bytes=2**20, log=lambda _: None)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    chunk.eval()
    record = {"ids": ids, "logits": megatron_logits(chunk, ids)}
    if use_engram:
        record["greedy"] = megatron_greedy(chunk, ids[:, :8], 32)
    torch.save(record, root / "megatron.pt")


def trainer_model(cfg):
    """Model (megatron DDP) and optimizer as the trainer builds them (training/job.py)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from engram_train.training.optimizer import build_optimizer

    config = build_transformer_config(cfg)
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    model = build_model(config, VOCAB, int(cfg.train.seq_length), ddp)
    t = cfg.train
    opt = OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
        clip_grad=t.clip_grad, bf16=config.bf16, fp16=config.fp16,
        params_dtype=config.params_dtype, use_distributed_optimizer=True)
    return config, model, build_optimizer(opt, model, config)


def imported_loss(imported: Path, batch: dict, engram: str | None) -> float:
    """The loss of the imported checkpoint as the trainer loads it (optimizer included)."""
    from megatron.core.utils import unwrap_model

    preset = OmegaConf.load(imported / "conf" / "model" / "hf_import.yaml")
    cfg = run_config([], False)  # the demo tokenizer, copied into the imported folder
    with open_dict(cfg):
        cfg.model = preset
        cfg.model.use_engram = engram is not None
        cfg.model.engram_value_init = engram or "zero"
    config, model, optimizer = trainer_model(cfg)
    load_checkpoint(imported, model, optimizer, load_engram=False)  # model-only: fresh optimizer
    chunk = unwrap_model(model)[0].eval()
    ids = batch["ids"]
    return megatron_loss(chunk, ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def main():
    args = parse_args({"--imported": dict(default=None), "--imported-pp2": dict(default=None),
                       "--imported-tp2ep2": dict(default=None), "--batch": dict(default=None)})
    out = Path(args.out)
    initialize_distributed(ParallelSizes(), seed=3)
    for name, overrides in CASES.items():
        export_case(out, name, overrides, use_engram=False)
    export_case(out, "engram", [], use_engram=True)
    export_case(out, "engram_mhc", ["model.enable_hyper_connections=true"], use_engram=True)
    losses = {}
    if args.imported:
        batch = torch.load(args.batch)
        for label, engram in [("backbone", None), ("engram_zero", "zero"), ("engram_normal", "normal")]:
            losses[label] = imported_loss(Path(args.imported), batch, engram)
    if args.imported_pp2:  # imported on two pipeline stages, loaded on one rank
        losses["backbone_pp2"] = imported_loss(Path(args.imported_pp2), batch, None)
    if args.imported_tp2ep2:  # imported at TP2 x EP2, loaded on one rank with Engram added
        losses["engram_zero_tp2ep2"] = imported_loss(Path(args.imported_tp2ep2), batch, "zero")
    (out / "import_losses.json").write_text(json.dumps(losses))
    write_result(args.out, {"cases": [*CASES, "engram", "engram_mhc"], "losses": losses})


if __name__ == "__main__":
    main()
