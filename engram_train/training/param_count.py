"""Parameter counts of a run configuration, from the model built on the meta device.

    python -m engram_train.training.param_count model=engram_27b --world-size 64 --vocab-size 129280 \\
        system.tensor_model_parallel_size=2 system.pipeline_model_parallel_size=2

validates the run configuration for ``--world-size`` processes (without starting them, and
without the data files: ``data.path`` need not exist here), builds the model exactly as the
trainer does but on the meta device (no memory, no initialization) as one rank with TP = PP =
EP = 1 (the counts do not depend on the layout), and prints JSON:

- ``total``: every parameter (embeddings, output layer, all experts, Engram tables and branches);
- ``activated``: parameters one token's forward reads, as MoE papers count them: the input
  embedding is excluded (a token reads one row), routed experts count ``topk / num_experts`` of
  their parameters, Engram tables are excluded (a token reads ``(N-1)*H`` rows per Engram layer)
  while the Engram projections, norms and conv count in full; the output layer counts;
- ``engram_tables`` / ``engram_dense``: the tables, and the rest of the Engram branches;
- ``embedding``, ``output_layer``, ``routed_experts``, ``moe_layers``;
- ``engram_table_bytes_per_param`` / ``engram_table_bytes``: what a table parameter costs with
  its optimizer state for the chosen ``engram_table_dtype``, ``engram_optimizer``,
  ``engram_master_weights`` and ``engram_optimizer_state_dtype`` (value, master, moments), and
  all tables' total (summed over shards; with host placement, host memory).

``--vocab-size`` sets the tokenizer vocabulary (padded as the trainer pads it); without it the
configured ``data.tokenizer`` is read. Flags and Hydra overrides may come in any order. Without
``--world-size`` (and no ``WORLD_SIZE`` in the environment) the layout is not checked: the counts
are the same for every layout, and a note on stderr says what was skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from engram_train.config import register
from engram_train.models.presets import CONF_DIR


@dataclass
class ParamCounts:
    total: int
    activated: int
    engram_tables: int
    engram_dense: int
    embedding: int
    output_layer: int
    routed_experts: int
    moe_layers: int


def count_parameters(model: torch.nn.Module, config) -> ParamCounts:
    """Counts of one full (unsharded) model; see the module docstring for the definitions."""
    totals: dict[str, int] = defaultdict(int)
    routed_per_layer: dict[str, int] = defaultdict(int)
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        n = param.numel()
        totals["total"] += n
        if getattr(param, "is_engram_table", False):
            totals["engram_tables"] += n
        elif getattr(param, "is_engram", False):
            totals["engram_dense"] += n
        elif name.startswith("embedding.word_embeddings."):
            totals["embedding"] += n
        elif name.startswith("output_layer."):
            totals["output_layer"] += n
        elif ".mlp.experts." in name or ".ffn.experts." in name:  # DeepSeek-V3's, V4.1's
            routed_per_layer[name.split(".experts.")[0]] += n
    routed = sum(routed_per_layer.values())
    activated = totals["total"] - totals["embedding"] - totals["engram_tables"] - routed
    if routed:
        topk, experts = config.moe_router_topk, config.num_moe_experts
        activated += sum(n * topk // experts for n in routed_per_layer.values())
    return ParamCounts(
        total=totals["total"], activated=activated, engram_tables=totals["engram_tables"],
        engram_dense=totals["engram_dense"], embedding=totals["embedding"],
        output_layer=totals["output_layer"], routed_experts=routed,
        moe_layers=len(routed_per_layer),
    )


@contextlib.contextmanager
def meta_device():
    """``torch.device("meta")`` that also holds when the CPU compatibility layer is installed.

    torch's device context recognises factory functions by identity, from a set it computes
    once; when that happens after the layer wrapped ``torch.empty``/``zeros``/... the set holds
    the wrappers, and the wrapped originals (what actually runs) would allocate real CPU
    memory. The originals are added to the set (they are factories: this only restores what
    the context is meant to catch)."""
    from torch.utils import _device

    constructors = _device._device_constructors()
    constructors.update(
        f.__wrapped__ for f in list(constructors) if callable(getattr(f, "__wrapped__", None))
    )
    with torch.device("meta"):
        yield


def build_on_meta(config, vocab_size: int, max_sequence_length: int) -> torch.nn.Module:
    """The whole model as one rank (TP = PP = EP = 1) on the meta device, uninitialized.

    Needs torch.distributed and megatron's parallel state for one process
    (``initialize_distributed(ParallelSizes())``).
    """
    from engram_train.models.builder import build_gpt_model

    one_rank = replace(
        config, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1,
        expert_tensor_parallel_size=1, sequence_parallel=False, perform_initialization=False,
        engram_embedding_parallel_size=1, pipeline_model_parallel_layout=None,
        num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
    )
    with meta_device():
        model = build_gpt_model(one_rank, vocab_size, max_sequence_length)
    real = [name for name, p in model.named_parameters() if not p.is_meta]
    if real:
        raise RuntimeError(f"parameters allocated off the meta device: {real[:5]}")
    return model


def run_config_counts(cfg, world_size: int | None, vocab_size: int | None = None) -> dict:
    """Validate ``cfg`` for ``world_size`` processes (data files not needed; ``None``: no
    layout check) and count the model's parameters on the meta device. torch.distributed must
    be set up for one process."""
    from engram_train.training.run_config import (
        build_transformer_config,
        padded_vocab_size,
        validate_run_config,
    )

    if world_size is not None:
        config = validate_run_config(cfg, world_size, check_data=False)
    else:
        config = build_transformer_config(cfg)
    if vocab_size is None:
        from engram_train.data import load_tokenizer

        vocab_size = load_tokenizer(cfg.data.tokenizer).vocab_size
    padded = padded_vocab_size(vocab_size, config.tensor_model_parallel_size)
    model = build_on_meta(config, padded, int(cfg.train.seq_length))
    counts = asdict(count_parameters(model, config))
    if config.use_engram:
        from engram_train.training.run_config import engram_table_bytes_per_param

        per_param = engram_table_bytes_per_param(config)
        counts.update(engram_table_bytes_per_param=per_param,
                      engram_table_bytes=int(per_param * counts["engram_tables"]))
    return dict(counts, vocab_size=padded, world_size=world_size)


def compose_config(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="train", overrides=list(overrides))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    env_world = os.environ.get("WORLD_SIZE")
    parser.add_argument("--world-size", type=int, default=int(env_world) if env_world else None,
                        help="processes the configuration's layout is validated for (none are "
                        "started); default: WORLD_SIZE, else the layout is not checked")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="tokenizer vocabulary size (default: read data.tokenizer)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for engram-train")
    # Flags before, between or after the overrides (`model=x --world-size 8` as well).
    args = parser.parse_intermixed_args(argv)

    from engram_train.logs import quiet_known_warnings

    quiet_known_warnings()
    from engram_train.runtime import ParallelSizes, destroy_distributed, initialize_distributed
    from engram_train.errors import EngramError

    cfg = compose_config(args.overrides)
    if args.world_size is None:
        print("param_count: layout not checked (no --world-size); the counts do not depend on it",
              file=sys.stderr)
    os.environ["WORLD_SIZE"], os.environ["RANK"] = "1", "0"
    initialize_distributed(ParallelSizes())
    try:
        counts = run_config_counts(cfg, args.world_size, args.vocab_size)
    except EngramError as e:
        where = f" for --world-size {args.world_size}" if args.world_size else ""
        raise SystemExit(f"param_count: invalid configuration{where}: {e}") from None
    finally:
        destroy_distributed()
    print(json.dumps(counts, indent=1))


if __name__ == "__main__":
    main()
