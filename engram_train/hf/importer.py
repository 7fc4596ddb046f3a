"""``engram-import-hf``: a transformers DeepSeek-V3 folder -> a checkpoint the trainer continues.

    engram-import-hf --hf DIR --out CKPT_DIR [--tokenizer PATH] [--preset-name NAME]

The backbone is built exactly as the trainer builds it (model, megatron DDP, a fresh optimizer),
on one process or split over pipeline stages (torchrun, ``--pipeline-parallel-size``); each
stage fills its layers from the folder one tensor at a time (fp8 dequantized on the
fly, ``rope_interleave: false`` rows reordered to megatron's interleaved layout), and the
project's own checkpoint save writes ``CKPT_DIR/iter_0000000`` with its manifest and run
identity. The model preset the folder implies goes to ``CKPT_DIR/conf/model/NAME.yaml``
(Engram off, ``engram_value_init: zero``); the trainer adds Engram with
``checkpoint.load_engram=false`` (docs/huggingface.md). Memory per process: its share of the
model, its optimizer state and the save's copies, plus one folder tensor.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engram_train.errors import EngramError
from engram_train.hf.config_map import HFConfigError, preset_from_hf
from engram_train.hf.names import hf_pieces, local_to_global, rope_permutation
from engram_train.hf.source import HFFolder, HFSourceError


class HFImportError(EngramError, ValueError):
    """The folder cannot be imported; the message names the field, tensor or option."""


def model_section(preset: dict, layers: int, engram_layer_ids=None) -> dict:
    """The tiny preset's keys (Engram and mHC options included) with the folder's backbone,
    Engram off and its value projection starting at zero."""
    from omegaconf import OmegaConf

    from engram_train.models.presets import CONF_DIR

    section = OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / "model" / "deepseek_v3_tiny.yaml"))
    section.update(preset)
    ids = engram_layer_ids or sorted({min(1, layers - 1), layers // 2})
    section.update(use_engram=False, engram_value_init="zero", engram_layer_ids=list(ids))
    return section


def _mtp_names(folder: HFFolder, layers: int) -> list[str]:
    pattern = re.compile(r"^model\.layers\.(\d+)\.")
    return [n for n in folder.names() if (m := pattern.match(n)) and int(m.group(1)) >= layers]


def _permute_rope(name: str, value: torch.Tensor, doc: dict) -> torch.Tensor:
    """transformers' ``rope_interleave: false`` layout -> megatron's interleaved pairs."""
    rope, nope = int(doc["qk_rope_head_dim"]), int(doc["qk_nope_head_dim"])
    order = torch.tensor(rope_permutation(rope))
    if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
        heads = value.view(int(doc["num_attention_heads"]), nope + rope, -1)
        heads[:, nope:] = heads[:, nope:][:, order]
        return value
    if name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
        start = int(doc["kv_lora_rank"])
        value[start:] = value[start:][order]
    return value


def global_names(chunk: torch.nn.Module) -> dict[str, tuple[str, int | None]]:
    """This rank's state-dict names -> (dist-checkpoint key, global expert or None): a pipeline
    stage numbers its layers from 0 and an expert-parallel rank its experts; megatron's layers
    know their global number and their experts' global indices."""
    layers = {j: (layer.layer_number - 1, getattr(layer.mlp, "local_expert_indices", None))
              for j, layer in enumerate(chunk.decoder.layers)}
    names = {}
    for name, tensor in chunk.state_dict(keep_vars=True).items():
        if "_extra_state" in name or not isinstance(tensor, torch.Tensor):
            continue
        match = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
        if match:
            layer, experts = layers[int(match.group(1))]
            key, expert = local_to_global(f"decoder.layers.{layer}.{match.group(2)}")
            names[name] = (key, None if expert is None else experts[expert])
        else:
            names[name] = (name, None)
    return names


def fill_model(chunk: torch.nn.Module, folder: HFFolder, doc: dict, vocab: int,
               num_experts: int | None) -> tuple[set[str], list[str]]:
    """Copy the folder's tensors into `chunk` (this rank's megatron model, any pipeline stage
    and expert-parallel rank, TP 1); returns (folder tensors used, warnings)."""
    tied = bool(doc.get("tie_word_embeddings")) and "lm_head.weight" not in folder
    hf_rows = int(doc["vocab_size"])
    interleaved = doc.get("rope_interleave", True)
    used, warnings = set(), []
    state = chunk.state_dict(keep_vars=True)
    for name, (key, expert) in global_names(chunk).items():
        tensor = state[name]
        shape = (num_experts, *tensor.shape) if expert is not None else tuple(tensor.shape)
        rows = min(vocab, hf_rows)
        for piece in hf_pieces(key, shape, rows):
            if expert is not None and piece.start[0] != expert:
                continue
            source = "model.embed_tokens.weight" if tied and piece.name == "lm_head.weight" else piece.name
            if source not in folder:
                raise HFImportError(f"{folder.folder} has no {source} (megatron {name} needs it)")
            value = folder.read(source)
            if tuple(value.shape) != (tuple(piece.shape) if piece.name not in (
                    "model.embed_tokens.weight", "lm_head.weight") else (hf_rows, piece.shape[1])):
                raise HFImportError(f"{source} has shape {tuple(value.shape)}, the model built "
                                    f"from config.json needs {piece.shape}")
            if not interleaved:
                value = _permute_rope(source, value, doc)
            box = list(zip(piece.start, piece.size))[1:] if expert is not None else list(
                zip(piece.start, piece.size))
            target = tensor.data
            for dim, (start, size) in enumerate(box):
                target = target.narrow(dim, start, size)
            with torch.no_grad():
                target.copy_(value[: piece.shape[0]] if target.shape != value.shape else value)
            used.add(source)
        if key in ("embedding.word_embeddings.weight", "output_layer.weight") and rows < shape[0]:
            with torch.no_grad():
                tensor.data[rows:].zero_()
            warnings.append(f"{name}: rows {rows}..{shape[0] - 1} (megatron's padding beyond "
                            f"config.json vocab_size={hf_rows}) start at zero")
    if hf_rows > vocab:
        warnings.append(f"config.json vocab_size={hf_rows} > the tokenizer's padded {vocab}: "
                        f"rows {vocab}.. of the embedding and lm_head are not imported")
    if tied:
        warnings.append("tie_word_embeddings: the output layer starts as a copy of the embedding "
                        "(the trainer keeps them apart)")
    return used, warnings


def check_all_used(folder: HFFolder, used: set[str], skip: set[str]) -> None:
    """Every folder tensor landed on some rank (`skip` aside)."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(used))
    left = sorted(set(folder.names()) - set().union(*map(set, gathered)) - skip)
    if left:
        raise HFImportError(f"{len(left)} tensors of {folder.folder} have no place in the model "
                            f"built from its config.json, e.g. {left[:4]}")


def _run_config(section: dict, tokenizer: Path, seq_length: int, pipeline: int = 1):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    from engram_train.models.presets import CONF_DIR

    with initialize_config_dir(config_dir=str(Path(CONF_DIR).resolve()), version_base=None):
        cfg = compose("train", overrides=[
            f"data.tokenizer={tokenizer}", f"train.seq_length={seq_length}",
            f"system.pipeline_model_parallel_size={pipeline}"])
    with open_dict(cfg):
        cfg.model = OmegaConf.create(section)
    return cfg


def _build(cfg, vocab: int):
    """Model and optimizer as the trainer builds them (training/job.py), in the layout of
    ``cfg.system`` (pipeline stages; TP and EP 1)."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from engram_train.models.builder import build_model
    from engram_train.runtime import ParallelSizes, initialize_distributed
    from engram_train.training.run_config import build_transformer_config

    from engram_train.training.run_config import parallel_sizes

    config = build_transformer_config(cfg)
    sizes = parallel_sizes(cfg)
    if not dist.is_initialized():
        initialize_distributed(sizes, seed=int(cfg.train.seed))
    t = cfg.train
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    model = build_model(config, vocab, int(t.seq_length), ddp)
    opt = OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
        clip_grad=t.clip_grad, bf16=config.bf16, fp16=config.fp16,
        params_dtype=config.params_dtype, use_distributed_optimizer=True)
    return config, model, opt


def fresh_adam_state(optimizer) -> None:
    """Adam's state before its first step (zero moments, step 0) for every parameter, so that
    the optimizer can be saved (megatron's state_dict needs a step) and the trainer's first step
    is Adam's first. megatron's own dummy-step init would apply weight decay to the weights."""
    chain = getattr(optimizer, "chained_optimizers", [optimizer])
    for part in chain:
        inner = getattr(part, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                }


def import_hf(hf: str | Path, out: str | Path, *, tokenizer: str | Path | None = None,
              preset_name: str = "hf_import", drop_mtp: bool = False, engram_layer_ids=None,
              seq_length: int = 4096, pipeline: int = 1,
              log: Callable[[str], None] | None = None) -> Path:
    """Write `hf` as checkpoint `out` (iteration 0) and its preset; returns the preset file.
    With `pipeline` > 1 (torchrun, that many processes) each stage holds its layers."""
    import torch.distributed as dist
    from megatron.core.utils import unwrap_model
    from omegaconf import OmegaConf

    from engram_train.checkpoint import has_checkpoints, save_checkpoint
    from engram_train.data import load_tokenizer
    from engram_train.engram.compressed_tokenizer import resolve_tokenizer_file
    from engram_train.training.optimizer import build_optimizer
    from engram_train.training.run_config import padded_vocab_size
    from engram_train.training.run_identity import run_identity

    log = log or (lambda message: print(f"engram-import-hf: {message}", flush=True))
    started = time.perf_counter()
    hf, out = Path(hf), Path(out)
    if not (hf / "config.json").is_file():
        raise HFImportError(f"--hf {hf}: no config.json (give a transformers model folder)")
    if has_checkpoints(out):
        raise HFImportError(f"--out {out} already holds checkpoints; choose an empty folder")
    doc = json.loads((hf / "config.json").read_text())
    try:
        preset = preset_from_hf(doc)
        folder = HFFolder(hf, tuple((doc.get("quantization_config") or {}).get(
            "weight_block_size", (128, 128))))
    except (HFConfigError, HFSourceError) as err:
        raise HFImportError(str(err)) from None
    layers = int(doc["num_hidden_layers"])
    mtp = _mtp_names(folder, layers)
    if mtp and not drop_mtp:
        raise HFImportError(
            f"config.json num_nextn_predict_layers={doc.get('num_nextn_predict_layers')}: the "
            f"folder holds {len(mtp)} multi-token-prediction tensors (model.layers.{layers}.*), "
            "which the trainer does not train; pass --drop-mtp to import without them")
    tokenizer_file = resolve_tokenizer_file(tokenizer or hf, field="--tokenizer")
    vocab = padded_vocab_size(load_tokenizer(tokenizer_file).vocab_size, 1)
    section = model_section(preset, layers, engram_layer_ids)
    cfg = _run_config(section, tokenizer_file, seq_length, pipeline)
    config, model, opt = _build(cfg, vocab)
    used, warnings = fill_model(unwrap_model(model)[0], folder, doc, vocab, config.num_moe_experts)
    folder.close()
    check_all_used(folder, used, set(mtp))
    for warning in warnings:
        log(f"warning: {warning}")
    optimizer = build_optimizer(opt, model, config)  # after the fill: its state starts from it
    fresh_adam_state(optimizer)
    save_checkpoint(out, 0, model, optimizer,
                    extra={"consumed_samples": 0, "imported_from": str(hf.resolve())},
                    run_identity=run_identity(config, vocab))
    preset_file = out / "conf" / "model" / f"{preset_name}.yaml"
    if dist.get_rank() == 0:
        preset_file.parent.mkdir(parents=True, exist_ok=True)
        section["engram_tokenizer_name_or_path"] = "${data.tokenizer}"
        preset_file.write_text(f"# Imported from {hf.resolve()} by engram-import-hf.\n"
                               + OmegaConf.to_yaml(OmegaConf.create(section)))
        log(f"wrote {out}/iter_0000000 and {preset_file} in {time.perf_counter() - started:.1f} s")
    dist.barrier()
    return preset_file


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engram-import-hf",
        description="Import a transformers DeepSeek-V3 folder as a checkpoint that engram-train "
                    "continues, with Engram added (docs/huggingface.md).")
    parser.add_argument("--hf", required=True, metavar="DIR", help="config.json + safetensors")
    parser.add_argument("--out", required=True, metavar="CKPT_DIR", help="checkpoint folder to write")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="tokenizer.json or its folder (default: the one in --hf)")
    parser.add_argument("--preset-name", default="hf_import",
                        help="name of the model preset written to CKPT_DIR/conf/model/")
    parser.add_argument("--engram-layer-ids", type=int, nargs="+", default=None,
                        help="Engram layers of the preset (default: 1 and num_layers // 2)")
    parser.add_argument("--drop-mtp", action="store_true",
                        help="import without the multi-token-prediction layers")
    parser.add_argument("--seq-length", type=int, default=4096,
                        help="train.seq_length the model is built for (RoPE tables)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1,
                        help="pipeline stages the model is split over (run under torchrun)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        import_hf(args.hf, args.out, tokenizer=args.tokenizer, preset_name=args.preset_name,
                  drop_mtp=args.drop_mtp, engram_layer_ids=args.engram_layer_ids,
                  seq_length=args.seq_length, pipeline=args.pipeline_parallel_size)
    except EngramError as err:
        raise SystemExit(f"engram-import-hf: error: {err}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
