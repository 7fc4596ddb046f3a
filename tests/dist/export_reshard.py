"""One rank loads a checkpoint that engram-train saved under another layout (TP2 x PP2 x eps 2),
saves it again as a single-rank checkpoint, and records what its Engram modules compute.

Written to --out:
- ``engram_io.safetensors``: the input ids [B, S] of one forward pass and, per Engram layer L,
  ``layer<L>.hidden`` (the Engram module's input, [S, B, d]), ``layer<L>.hash_ids`` ([S, B, K],
  what the model hashed), ``layer<L>.memory`` ([S, B, E], the rows it gathered) and
  ``layer<L>.output`` ([S, B, d], the module's output, residual not included);
- ``model_state.safetensors``: the single-rank model's state dict (``_extra_state`` left out);
- ``rank0.json``: the iteration loaded and the layer ids recorded;
- ``hf_sharded/``, ``hf_single/``: both checkpoints exported with ``--format hf``, which must
  be byte-identical (the script fails otherwise; ``hf_exports.json`` lists the files compared).
The single-rank checkpoint goes to --save (a checkpoint.save folder).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
from common import parse_args, write_result
from omegaconf import OmegaConf
from safetensors.torch import save_file

from engram_train.checkpoint import (
    iteration_dir,
    latest_iteration,
    load_checkpoint,
    save_checkpoint,
)
from engram_train.engram.compressed_tokenizer import CompressedTokenizer
from engram_train.export.checkpoint_reader import DistCheckpointReader
from engram_train.models.builder import build_model
from engram_train.runtime import ParallelSizes, initialize_distributed
from engram_train.training.run_config import build_transformer_config

BATCH, SEQ = 2, 48


def input_ids(vocab: int, pad_id: int) -> torch.Tensor:
    """Two rows of ids: random, and random with a run of pads in the middle."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    ids[1, 20:24] = pad_id
    return ids


def compare_hf_exports(sharded: Path, single: Path, config: Path, out: Path) -> None:
    """``engram-export --format hf`` of the TP2 x PP2 x eps 2 checkpoint and of its single-rank
    copy: the same files, byte for byte."""
    from engram_train.export.hf_export import export_hf

    a = export_hf(sharded, out / "hf_sharded", config=config, log=lambda _: None)
    b = export_hf(single, out / "hf_single", config=config, log=lambda _: None)
    files = sorted(p.name for p in a.iterdir())
    if files != sorted(p.name for p in b.iterdir()):
        raise AssertionError(f"--format hf exports hold different files: {files}")
    differ = [n for n in files if (a / n).read_bytes() != (b / n).read_bytes()]
    if differ:
        raise AssertionError(f"--format hf exports of the two layouts differ in {differ}")
    (out / "hf_exports.json").write_text(json.dumps({"files": files, "identical": True}))


def main():
    args = parse_args({"--ckpt": dict(required=True), "--config": dict(required=True),
                       "--save": dict(required=True)})
    cfg = OmegaConf.load(args.config)
    # The same model on one rank: only the layout changes.
    cfg.system.tensor_model_parallel_size = 1
    cfg.system.pipeline_model_parallel_size = 1
    cfg.model.engram_embedding_parallel_size = 1
    config = build_transformer_config(cfg)
    initialize_distributed(ParallelSizes(), seed=3)

    iteration = latest_iteration(args.ckpt)
    reader = DistCheckpointReader(iteration_dir(args.ckpt, iteration))
    vocab = reader.tensors["embedding.word_embeddings.weight"].shape[0]
    model = build_model(config, vocab, cfg.train.seq_length)
    loaded, _ = load_checkpoint(args.ckpt, model, strict=False)  # optimizer state left out
    save_checkpoint(args.save, loaded, model)
    compare_hf_exports(Path(args.ckpt), Path(args.save), Path(args.config), Path(args.out))

    records = {}

    def engram_hook(module, inputs, kwargs, output):
        layer = module.layer_id
        memory = kwargs.get("memory")  # rows prefetched by the model, or looked up here
        if memory is None:
            memory = module.lookup(kwargs["hash_ids"])
        records[f"layer{layer}.hidden"] = inputs[0].detach().clone()
        records[f"layer{layer}.memory"] = memory.detach().clone()
        records[f"layer{layer}.output"] = output.detach().clone()

    def layer_hook(layer, args, kwargs):
        block = kwargs["context"]  # [L, B, S, K]: the micro-batch's hash ids
        records[f"layer{layer.engram_layer_id}.hash_ids"] = block[layer.engram_slot].transpose(
            0, 1).clone()

    chunk = model[0].module
    layers = [layer for layer in chunk.decoder.layers if hasattr(layer, "engram")]
    for layer in layers:
        layer.register_forward_pre_hook(layer_hook, with_kwargs=True)
        layer.engram.register_forward_hook(engram_hook, with_kwargs=True)
    raw_ids = CompressedTokenizer(config.engram_tokenizer_name_or_path).num_raw_ids
    ids = input_ids(min(vocab, raw_ids), config.engram_pad_id)
    positions = torch.arange(SEQ).expand(BATCH, SEQ).contiguous()
    with torch.no_grad():
        chunk.eval()
        chunk(ids, positions, None)
    records["input_ids"] = ids
    Path(args.out).mkdir(parents=True, exist_ok=True)
    state = {name: value.detach().clone().contiguous()
             for name, value in chunk.state_dict().items()
             if isinstance(value, torch.Tensor) and "_extra_state" not in name}
    save_file(state, str(Path(args.out) / "model_state.safetensors"))
    save_file({k: v.contiguous() for k, v in records.items()},
              str(Path(args.out) / "engram_io.safetensors"))
    write_result(args.out, {"iteration": loaded,
                            "layers": sorted(layer.engram_layer_id for layer in layers)})


if __name__ == "__main__":
    main()
