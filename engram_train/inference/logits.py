"""engram-logits: the logits a checkpoint gives for token ids, to compare a checkpoint (an import
above all) with another implementation of the same model.

    engram-logits --load CKPT --ids IDS.json --out OUT.safetensors
    torchrun --nproc-per-node 4 -m engram_train.inference.logits --load CKPT --ids IDS.json \\
        --out OUT.safetensors system.tensor_model_parallel_size=2 \\
        system.pipeline_model_parallel_size=2

``IDS.json`` is a list of equal-length token lists; ``OUT.safetensors`` holds one float32 tensor
``logits`` [batch, seq, vocab], vocab being the checkpoint's embedding rows (the tokenizer's
vocabulary padded as megatron pads it, as ``engram-export --format hf`` writes it).

The checkpoint knows its model: the run config is found as ``engram-export`` finds it
(``export/config_source.py``: ``--config``, the checkpoint's ``extra.run_config`` that
``engram-import-hf`` stores, ``config.yaml`` next to the checkpoint folder). The layout is one
process per model (tensor, pipeline, expert, context and Engram embedding-parallel sizes 1)
unless ``key=value`` overrides of the run config say otherwise, as the trainer takes them; ranks
left over are data-parallel replicas that compute the same logits. Each rank builds its shard as
the trainer does (``models/builder.py``) and loads the checkpoint (``checkpoint/load.py``); each
sequence is one micro-batch through megatron's pipeline schedule (forward only), its Engram hash
ids computed from the ids as the trainer's data path computes them (``hash_block``: documents
and EOS as the config says) and its positions as megatron's GPT dataset gives them
(``data.reset_position_ids``). The last stage gathers the vocabulary-parallel logits over
tensor parallelism and sends them to global rank 0, which writes the file (a temporary file,
then a rename). Under sequence parallelism the ids are extended to a multiple of the
tensor-parallel size by repeating the last id, and the extension is cut off again. A DeepSeek-V4.1
model gets the extension marked as padding (``padding_mask``, megatron's ``GPTModel`` argument):
padding is no key, no compressed run, no routed expert's token and no Engram lookup, so the
logits are those of the given length (docs/reliability.md 'engram-logits on every layout');
megatron's GPT model (DeepSeek-V3) is causal token by token, and its extension tokens change
no earlier position.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engram_train.errors import ConfigError, EngramError, InputError
from engram_train.output_paths import probe_write

LOGITS = "logits"
IDS_EXAMPLE = "[[1, 2, 3], [4, 5, 6]]"
# One process per model unless an override says otherwise (module docstring).
LAYOUT_DEFAULTS = (
    "system.tensor_model_parallel_size=1",
    "system.pipeline_model_parallel_size=1",
    "system.virtual_pipeline_model_parallel_size=null",
    "system.expert_model_parallel_size=1",
    "system.context_parallel_size=1",
    "system.sequence_parallel=auto",
    "model.engram_embedding_parallel_size=1",
)


def read_ids(path: str | os.PathLike) -> torch.Tensor:
    """The ids of ``--ids``: int64 [batch, seq]; `InputError` naming the problem and the fix."""
    where = f"--ids {path}"
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as err:
        raise InputError(f"{where}: cannot read it ({err.strerror or err}); give a JSON file "
                         f"holding a list of equal-length token lists, e.g. {IDS_EXAMPLE}") from None
    except ValueError as err:
        raise InputError(f"{where}: not JSON ({err}); give a list of equal-length token lists, "
                         f"e.g. {IDS_EXAMPLE}") from None
    if not isinstance(doc, list) or not doc:
        what = "an empty list" if doc == [] else f"a JSON {type(doc).__name__}"
        raise InputError(f"{where} holds {what}: give at least one token list, e.g. {IDS_EXAMPLE}")
    for row, ids in enumerate(doc):
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            raise InputError(f"{where}: row {row} is not a list of integer token ids; give a list "
                             f"of token lists, e.g. {IDS_EXAMPLE}")
        if not ids:
            raise InputError(f"{where}: row {row} is empty; every row needs at least one id")
    lengths = [len(ids) for ids in doc]
    if len(set(lengths)) > 1:
        other = next(r for r, n in enumerate(lengths) if n != lengths[0])
        raise InputError(f"{where} is ragged: row 0 has {lengths[0]} ids, row {other} has "
                         f"{lengths[other]}; give rows of one length (cut them, or run the "
                         "lengths in separate files)")
    for row, ids in enumerate(doc):  # torch.tensor raises a bare ValueError beyond int64
        for pos, i in enumerate(ids):
            if not -2**63 <= i < 2**63:
                raise InputError(f"{where}: id {i} (row {row}, position {pos}) does not fit int64; "
                                 "token ids are small non-negative integers (the tokenizer's)")
    return torch.tensor(doc, dtype=torch.int64)


def check_vocabulary(ids: torch.Tensor, vocab: int, where: str, what: str) -> None:
    """Every id in [0, vocab); `InputError` naming the first one outside, its place and the
    range (``what`` says where the range comes from)."""
    outside = ((ids < 0) | (ids >= vocab)).nonzero()
    if len(outside):
        row, pos = (int(x) for x in outside[0])
        raise InputError(f"{where}: id {int(ids[row, pos])} (row {row}, position {pos}) is outside "
                         f"the vocabulary [0, {vocab}) of {what}; give ids of the tokenizer the "
                         "model was trained with")


def check_out(out: str | os.PathLike, force: bool) -> Path:
    out = Path(out)
    if out.is_dir():
        raise InputError(f"--out {out} is a folder; give a file name, e.g. {out}/logits.safetensors")
    if out.exists() and not force:
        raise InputError(f"--out {out} already exists; choose another file or pass --force to "
                         "replace it")
    if not out.parent.is_dir():
        raise InputError(f"--out {out}: folder {out.parent} does not exist; create it first")
    try:
        probe_write(out.parent)
    except OSError as e:
        raise InputError(f"--out {out}: cannot write in {out.parent} ({e.strerror or e}); choose a "
                         "folder this process can write to") from None
    return out


@dataclass
class LogitsPlan:
    """What `plan_logits` found before any process group: the run config with the layout, the
    model config, the checkpoint and its vocabulary, the hash mapping."""

    cfg: Any                 # the run config (typed), layout overrides applied
    model_config: Any        # EngramMLATransformerConfig
    directory: Path          # the iteration's checkpoint folder
    iteration: int | None
    vocab: int               # embedding rows of the checkpoint
    mapping: Any             # the Engram hash mapping (None without Engram)
    where: str               # where the run config came from


def layout_config(doc: dict, overrides: Sequence[str], where: str):
    """The run config ``doc`` with one process per model (`LAYOUT_DEFAULTS`) and then the
    ``key=value`` overrides; a key the run config does not know is refused by name."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from engram_train.config import typed_run_config

    for item in overrides:
        if "=" not in item or item.startswith(("+", "~")):
            raise ConfigError(f"{item!r} is not a key=value override of the run config, e.g. "
                              "system.tensor_model_parallel_size=2")
    try:
        cfg = OmegaConf.merge(OmegaConf.create(doc),
                              OmegaConf.from_dotlist([*LAYOUT_DEFAULTS, *overrides]))
    except OmegaConfBaseException as err:
        raise ConfigError(f"{where} with {' '.join(overrides)}: {err}") from None
    return typed_run_config(cfg)


def check_layout(cfg, world: int) -> None:
    """Layouts the logits cannot be computed in, refused by key; the world size checks."""
    from engram_train.training.run_config import parallel_sizes

    s = cfg.system
    if int(s.context_parallel_size) != 1:
        raise ConfigError(f"system.context_parallel_size={s.context_parallel_size}: engram-logits "
                          "runs without context parallelism (each rank would hold scattered "
                          "chunks of every sequence); drop the override")
    if s.virtual_pipeline_model_parallel_size is not None:
        raise ConfigError("system.virtual_pipeline_model_parallel_size: engram-logits runs one "
                          "model chunk per pipeline stage; drop the override")
    parallel_sizes(cfg).validate(world)


def plan_logits(load, overrides: Sequence[str] = (), *, config=None, iteration=None,
                world: int = 1) -> LogitsPlan:
    """Locate checkpoint `load` (its files' sizes against its manifest), find its run config,
    apply the layout, build the model config and the hash mapping, and check the run identity
    the checkpoint records against them; nothing is loaded yet."""
    from engram_train.checkpoint.manifest import check_checkpoint, read_manifest
    from engram_train.engram.compressed_tokenizer import TokenizerNotFoundError
    from engram_train.engram.variant import build_hash_mapping
    from engram_train.export.checkpoint_reader import CheckpointFormatError, DistCheckpointReader
    from engram_train.export.config_source import find_run_config
    from engram_train.export.locate import resolve_checkpoint
    from engram_train.training.run_config import build_transformer_config
    from engram_train.training.run_identity import check_run_identity, run_identity

    root, directory, iteration = resolve_checkpoint(load, iteration)
    problems = check_checkpoint(directory, checksums=False)
    if problems:
        raise InputError(f"checkpoint {directory} is damaged:\n  " + "\n  ".join(problems)
                         + "\nRestore these files, or give another iteration (--iteration N)")
    try:
        reader = DistCheckpointReader(directory)
    except CheckpointFormatError as err:
        raise InputError(f"--load {load}: {err}") from None
    common = reader.common_state()
    if iteration is None and common is not None and "iteration" in common:
        iteration = int(common["iteration"])
    doc, where = find_run_config(config, root, common)
    cfg = layout_config(doc, overrides, where)
    check_layout(cfg, world)
    model_config = build_transformer_config(cfg)
    if model_config.num_layers % model_config.pipeline_model_parallel_size:
        raise ConfigError(f"the model's {model_config.num_layers} layers do not split over "
                          f"system.pipeline_model_parallel_size="
                          f"{model_config.pipeline_model_parallel_size} stages; choose a divisor")
    embedding = reader.tensors.get("embedding.word_embeddings.weight")
    if embedding is None:
        raise InputError(f"--load {load}: {directory} holds no embedding.word_embeddings.weight; "
                         "give a checkpoint that engram-train or engram-import-hf wrote")
    vocab = int(embedding.shape[0])
    if vocab % model_config.tensor_model_parallel_size:
        raise ConfigError(f"system.tensor_model_parallel_size={model_config.tensor_model_parallel_size} "
                          f"must divide the checkpoint's {vocab} vocabulary rows")
    mapping = None
    if model_config.use_engram:
        try:
            mapping = build_hash_mapping(model_config, num_threads=int(cfg.data.hash_threads))
        except (ValueError, TokenizerNotFoundError) as err:
            raise ConfigError(f"{where}: model: {err} (override it: "
                              "model.engram_tokenizer_name_or_path=PATH)") from None
    manifest = read_manifest(directory)
    if manifest is not None:
        check_run_identity(manifest.get("run"), run_identity(model_config, vocab, mapping),
                           load_engram=True, where=f"{directory} (run config {where})")
    return LogitsPlan(cfg, model_config, directory, iteration, vocab, mapping, where)


def check_ids(ids: torch.Tensor, plan: LogitsPlan, where: str) -> None:
    """The ids against the model's vocabulary, and Engram's hash vocabulary with Engram."""
    check_vocabulary(ids, plan.vocab, where, f"the checkpoint ({plan.vocab} embedding rows)")
    if plan.mapping is not None:
        check_vocabulary(ids, int(plan.mapping.num_raw_ids), where,
                         "the Engram tokenizer (model.engram_tokenizer_name_or_path)")


def position_ids(cfg, tokens: torch.Tensor) -> torch.Tensor:
    """[1, S] positions of one sequence as megatron's GPT dataset gives them: 0..S-1, restarted
    after every end-of-document id with ``data.reset_position_ids``."""
    seq = tokens.shape[-1]
    if not cfg.data.reset_position_ids:
        return torch.arange(seq).unsqueeze(0)
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    from engram_train.data import load_tokenizer

    eod = load_tokenizer(cfg.data.tokenizer).eod
    positions = _get_ltor_masks_and_position_ids(tokens[0], eod, True, False, False, False)[-1]
    return positions.unsqueeze(0)


def microbatches(plan: LogitsPlan, ids: torch.Tensor) -> list[dict]:
    """One micro-batch per sequence, as the trainer's data path hands them to the model (hash
    ids from ``hash_block``); extended to a multiple of the tensor-parallel size under
    sequence parallelism, the extension marked as padding for a family whose model reads it
    (DeepSeek-V4.1's; module docstring)."""
    from engram_train.models.families import family_of

    tp, length = plan.model_config.tensor_model_parallel_size, ids.shape[1]
    if plan.model_config.sequence_parallel and length % tp:
        extra = tp - length % tp
        ids = torch.cat([ids, ids[:, -1:].expand(-1, extra)], dim=1)
    mark_padding = family_of(plan.model_config).reads_padding_mask and ids.shape[1] > length
    batches = []
    for row in ids.split(1):
        # `model_inputs` reads labels; the logits' forward drops them (`_logits_step`)
        batch = {"tokens": row, "labels": row, "position_ids": position_ids(plan.cfg, row)}
        if mark_padding:
            batch["padding_mask"] = torch.arange(row.shape[1]).unsqueeze(0) >= length
        if plan.mapping is not None:
            batch["engram_hash_ids"] = torch.as_tensor(plan.mapping.hash_block(row))
        batches.append(batch)
    return batches


def _logits_step(data_iterator, model):
    """megatron's forward step: the model's output without labels is its logits, [1, S, V/TP]
    on the last stage."""
    from engram_train.training.step import model_inputs

    batch = next(data_iterator)
    device = next(model.parameters()).device
    kwargs = model_inputs(batch, device)
    kwargs.pop("labels")
    if batch.get("padding_mask") is not None:  # DeepSeek-V4.1's extension (`microbatches`)
        kwargs["padding_mask"] = batch["padding_mask"].to(device)
    return model(**kwargs), _keep_output


def _keep_output(output: torch.Tensor, non_loss_data: bool = False) -> torch.Tensor:
    return output.detach()


def build_and_load(plan: LogitsPlan) -> list[torch.nn.Module]:
    """Process groups of the layout, this rank's model chunk as the trainer builds it (no DDP,
    no initialisation: every weight is loaded), the checkpoint loaded into it."""
    from engram_train.checkpoint.load import load_checkpoint_dir
    from engram_train.models.builder import build_model
    from engram_train.runtime import initialize_distributed
    from engram_train.training.run_config import parallel_sizes

    cfg = plan.cfg
    initialize_distributed(parallel_sizes(cfg), seed=int(cfg.train.seed),
                           timeout_minutes=int(cfg.system.distributed_timeout_minutes))
    plan.model_config.perform_initialization = False
    model = build_model(plan.model_config, plan.vocab, int(cfg.train.seq_length), wrap_with_ddp=False)
    load_checkpoint_dir(plan.directory, model, strict=False)  # optimizer state left out
    for chunk in model:
        chunk.eval()
    return model


def forward_logits(plan: LogitsPlan, model: list[torch.nn.Module], ids: torch.Tensor
                   ) -> torch.Tensor | None:
    """float32 [B, S, V] logits on global rank 0 (None on the other ranks): every sequence
    through megatron's schedule, forward only; the last stage gathers over tensor parallelism
    and sends them to rank 0."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    batches = microbatches(plan, ids)
    seq = batches[0]["tokens"].shape[1]
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=_logits_step, data_iterator=iter(batches), model=model[0],
            num_microbatches=len(batches), seq_length=seq, micro_batch_size=1,
            forward_only=True, collect_non_loss_data=True,
        )  # fmt: skip
    last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    logits = None
    if last_stage:
        logits = gather_from_tensor_model_parallel_region(torch.cat(outputs))
        logits = logits[:, : ids.shape[1]].float().contiguous()
    source = parallel_state.get_pipeline_model_parallel_last_rank()
    if dist.get_rank() == 0:
        if source != 0:
            logits = torch.empty(*ids.shape, plan.vocab, device=next(model[0].parameters()).device)
            dist.recv(logits, src=source)
        return logits.cpu()
    if last_stage and parallel_state.get_pipeline_model_parallel_first_rank() == 0:
        dist.send(logits, dst=0)
    return None


def write_logits(logits: torch.Tensor, out: str | os.PathLike, metadata: dict[str, str]) -> Path:
    """``out`` holding ``logits`` (float32), written to a temporary file beside it and renamed:
    a reader never sees a partial file."""
    from safetensors.torch import save_file

    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        save_file({LOGITS: logits.float().contiguous()}, str(tmp), metadata=metadata)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def layout_text(model_config) -> str:
    c = model_config
    parts = [f"tensor {c.tensor_model_parallel_size}", f"pipeline {c.pipeline_model_parallel_size}",
             f"expert {c.expert_model_parallel_size}"]
    if c.use_engram:
        parts.append(f"Engram embedding {c.engram_embedding_parallel_size}")
    return " x ".join(parts)


def run(args: argparse.Namespace, log: Callable[[str], None] | None = None) -> torch.Tensor | None:
    """The command without its exit handling: checks, forward, the file on rank 0; returns the
    logits on rank 0 (None elsewhere). The process groups stay up (`main` ends them)."""
    import torch.distributed as dist

    rank0 = int(os.environ.get("RANK", "0")) == 0
    log = log or (lambda text: print(f"engram-logits: {text}", file=sys.stderr, flush=True))
    out = check_out(args.out, args.force)
    ids = read_ids(args.ids)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan = plan_logits(args.load, args.overrides, config=args.config, iteration=args.iteration,
                       world=world)
    check_ids(ids, plan, f"--ids {args.ids}")
    model = build_and_load(plan)
    logits = forward_logits(plan, model, ids)
    if rank0:
        layout = layout_text(plan.model_config)
        write_logits(logits, out, {"checkpoint": str(plan.directory.resolve()),
                                   "iteration": str(plan.iteration), "layout": layout})
        log(f"wrote {out}: logits {list(logits.shape)} float32 of {plan.directory} (iteration "
            f"{plan.iteration}; run config {plan.where}) on {world} process(es), {layout}")
    dist.barrier()
    return logits


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engram-logits",
        description="Write a checkpoint's logits for given token ids (float32 [batch, seq, vocab] "
                    "under the name 'logits'), to compare the model with another implementation. "
                    "Run under torchrun for multi-rank layouts, given as run config overrides.")
    parser.add_argument("--load", required=True, metavar="CKPT",
                        help="checkpoint.save folder (or one iter_XXXXXXX folder)")
    parser.add_argument("--ids", required=True, metavar="IDS.json",
                        help=f"a JSON list of equal-length token lists, e.g. {IDS_EXAMPLE}")
    parser.add_argument("--out", required=True, metavar="OUT.safetensors", help="file to write")
    parser.add_argument("--iteration", type=int, default=None,
                        help="iteration to load (default: the latest)")
    parser.add_argument("--config", default=None, metavar="YAML",
                        help="the run's resolved config.yaml, when the checkpoint's is not found "
                             "by itself (as engram-export finds it)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out file")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="run config overrides, e.g. system.tensor_model_parallel_size=2 "
                             "system.pipeline_model_parallel_size=2 "
                             "model.engram_embedding_parallel_size=2 (default layout: one "
                             "process per model; other ranks are data-parallel replicas)")
    return parser


def main(argv: list[str] | None = None) -> None:
    """The console script: a project error ends with its message (once per node) and exit
    status 1, nothing written."""
    from engram_train.train import _exit_with_message

    args = build_parser().parse_args(argv)
    try:
        run(args)
    except EngramError as err:
        what = "invalid configuration: " if isinstance(err, ConfigError) else "error: "
        _exit_with_message(f"engram-logits: {what}{err}")
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            from engram_train.runtime import destroy_distributed

            destroy_distributed()


if __name__ == "__main__":
    main()
