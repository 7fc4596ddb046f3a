"""``engram-plan``: will this configuration fit? (docs/memory.md)

    engram-plan model=engram_27b system.tensor_model_parallel_size=2 \\
        system.pipeline_model_parallel_size=2 train.global_batch_size=64 \\
        --nproc-per-node 8 --nnodes 8 --device-memory 141GiB --host-memory 2TiB [--json]

Takes the trainer's Hydra overrides (the same composition and validation as ``engram-train``,
without reading the data files) and prints, for each pipeline stage, the device and host bytes
of one of its ranks with a breakdown, whether the run fits, and if not its largest items and
the fields that change them. ``--device cpu`` (the default without CUDA and without
``--device-memory``): device and host are one memory, and ``total_bytes_per_rank`` is the
predicted peak RSS of a rank.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from dataclasses import replace

from engram_train.errors import EngramError

UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
         "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


class PlanError(EngramError, ValueError):
    """A bad ``engram-plan`` argument; the message names it and the fix."""


def parse_bytes(text: str, flag: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise PlanError(f"{flag}={text!r}: give a size such as 141GiB, 2TiB or 80GB")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def make_plan(cfg, world: int, nproc_per_node: int, vocab_size: int | None = None,
              device: str = "cpu", device_memory: int | None = None, host_memory: int | None = None,
              cpu_baseline: int | None = None, model=None, cache: dict | None = None):
    """The plan of ``cfg`` on ``world`` ranks. torch.distributed must be set up for one process
    (the model is built on the meta device as one rank). ``model``: a meta model of the same
    model config built before (it does not depend on the layout: layout searches reuse it);
    ``cache``: a dict a search passes to every call, to keep the meta model (and V4.1's
    validated config) between layouts."""
    from engram_train.memory_plan.plan_layout import layout_of
    from engram_train.memory_plan.model_bytes import stage_of_layer, stage_params
    from engram_train.memory_plan.plan_report import Plan, plan_stage
    from engram_train.models.families import family_of_section
    from engram_train.training.run_config import padded_vocab_size, parallel_sizes, validate_run_config

    terms = family_of_section(cfg.model).plan  # the family's own terms (DeepSeek-V4.1's), or None
    cache = {} if cache is None else cache
    if terms is not None:  # the layout the trainer refuses for now, planned
        config, notes = _validated_with_terms(cfg, world, cache, terms)
    else:
        config, notes = validate_run_config(cfg, world, check_data=False), []
    if vocab_size is None:
        from engram_train.data import load_tokenizer

        vocab_size = load_tokenizer(cfg.data.tokenizer).vocab_size
    padded = padded_vocab_size(vocab_size, int(cfg.system.tensor_model_parallel_size))
    layout = layout_of(cfg, config, world, nproc_per_node)
    if terms is not None:  # the sizes of cfg, not of the validated copy
        layout = terms.layout_sizes(config, layout, parallel_sizes(cfg))
    model = cache.setdefault("model", model)
    if model is None:
        model = cache["model"] = meta_model(config, padded, int(cfg.train.seq_length))
    if terms is not None:
        config = terms.with_recompute(cfg, config)
    ranks = []
    for sp in stage_params(model, config, layout):
        layers = [i for i in range(config.num_layers) if stage_of_layer(i, config.num_layers, layout) == sp.stage]
        ranks.append(plan_stage(config, layout, sp, layers, cfg.system.precision, padded, device,
                                bool(cfg.checkpoint.save), cpu_baseline))
    return Plan(layout, device, device_memory, host_memory, ranks, notes=notes)


def _validated_with_terms(cfg, world: int, cache: dict, terms):
    """The family's config (DeepSeek-V4.1's), validated with its layout sizes at 1 (its
    ``validation_cfg``; once per search, kept in ``cache``), and the layout's own checks; the
    notes of the report."""
    from engram_train.training.run_config import ConfigError, parallel_sizes, validate_run_config

    config = cache.get("validated_config")
    if config is None:
        s = cfg.system
        dp = world // (int(s.tensor_model_parallel_size) * int(s.pipeline_model_parallel_size)
                       * int(s.context_parallel_size or 1))
        copy = terms.validation_cfg(cfg)
        # the copy's tensor-parallel size is 1: its sequence parallelism follows it (the
        # layout's own, cfg's, is what the plan reads: plan_layout.layout_of)
        copy.system.sequence_parallel = "auto"
        config = validate_run_config(copy, max(dp, 1), check_data=False)
        cache["validated_config"] = config
    terms.check_layout(cfg, config, world, parallel_sizes(cfg))
    if cache.get("searching"):  # the layout found gets its note (search_plan)
        return config, []
    try:  # what the trainer itself refuses of this layout today
        validate_run_config(cfg, world, check_data=False)
    except ConfigError as e:
        return config, [f"{terms.not_trainable}: the trainer refuses it today: {e}"]
    return config, []


def meta_model(config, padded_vocab: int, seq_length: int):
    """The whole model as one rank on the meta device (no weights)."""
    from engram_train.training.param_count import build_on_meta

    # Host-resident tables would be allocated in host memory: placement does not change shapes.
    meta_config = replace(config, engram_table_placement="device") if config.use_engram else config
    return build_on_meta(meta_config, padded_vocab, seq_length)


def _default_host_memory() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:  # pragma: no cover - psutil is a dependency
        return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="engram-plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node (N)")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes (M); world = N x M")
    parser.add_argument("--device-memory", default=None, help="memory of one device, e.g. 141GiB")
    parser.add_argument("--host-memory", default=None,
                        help="host memory of one node, e.g. 2TiB (default: this machine's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="cpu: device and host are one memory (default without CUDA and "
                        "without --device-memory)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="tokenizer vocabulary size (default: read data.tokenizer)")
    parser.add_argument("--cpu-baseline", default=None,
                        help="measured fixed bytes of a CPU rank (default: fixed.CPU_PROCESS_BYTES)")
    parser.add_argument("--search-nodes", default=None, metavar="N",
                        help="find the smallest node count <= N at which the run fits, deriving "
                        "the parallel sizes the config leaves at 1 (docs/memory.md); replaces --nnodes")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for engram-train")
    args = parser.parse_intermixed_args(argv)

    from engram_train.logs import quiet_known_warnings

    quiet_known_warnings()
    try:
        plan = _plan_from_args(args)
    except PlanError as e:
        print(f"engram-plan: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print(json.dumps(plan.to_json(), indent=1) if args.json else plan.to_text())


def _plan_from_args(args):
    import torch

    from engram_train.training.param_count import compose_config
    from engram_train.training.run_config import ConfigError

    for flag in ("nproc_per_node", "nnodes", "vocab_size"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise PlanError(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be >= 1")
    search = _search_nodes_arg(args)
    device_memory = parse_bytes(args.device_memory, "--device-memory") if args.device_memory else None
    host_memory = parse_bytes(args.host_memory, "--host-memory") if args.host_memory else _default_host_memory()
    baseline = parse_bytes(args.cpu_baseline, "--cpu-baseline") if args.cpu_baseline else None
    device = args.device or ("cuda" if torch.cuda.is_available() or device_memory else "cpu")
    if device == "cuda" and device_memory is None:
        if not torch.cuda.is_available():
            raise PlanError("--device cuda needs --device-memory (e.g. 141GiB for an H200)")
        device_memory = torch.cuda.get_device_properties(0).total_memory
    world = args.nproc_per_node * args.nnodes
    try:
        cfg = compose_config(args.overrides)
    except Exception as e:  # Hydra's override and composition errors
        raise PlanError(f"invalid overrides: {e}") from None
    try:
        with one_rank():
            if search:
                return search_plan(cfg, search, args.nproc_per_node, args.vocab_size, device,
                                   device_memory, host_memory, baseline)
            return make_plan(cfg, world, args.nproc_per_node, args.vocab_size, device,
                             device_memory, host_memory, baseline)
    except ConfigError as e:
        raise PlanError(f"invalid configuration for {world} ranks: {e}") from None


@contextlib.contextmanager
def one_rank():
    """torch.distributed and megatron's parallel state for this process alone (what `make_plan`
    needs), ended on leaving; torchrun's ``WORLD_SIZE`` and ``RANK`` are put back."""
    from engram_train.runtime import ParallelSizes, destroy_distributed, initialize_distributed

    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK")}
    os.environ["WORLD_SIZE"], os.environ["RANK"] = "1", "0"
    try:
        initialize_distributed(ParallelSizes())
        yield
    finally:
        destroy_distributed()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _search_nodes_arg(args) -> int | None:
    if args.search_nodes is None:
        return None
    text = str(args.search_nodes)
    if not text.isdigit() or int(text) < 1:
        raise PlanError(f"--search-nodes={text!r} must be a whole number of nodes >= 1")
    if args.nnodes != 1:
        raise PlanError(f"--search-nodes={text} and --nnodes={args.nnodes}: give one of them "
                        "(--search-nodes chooses the node count)")
    return int(text)


def search_plan(cfg, max_nodes: int, nproc_per_node: int, vocab: int | None, device: str,
                device_memory: int | None, host_memory: int | None, baseline: int | None = None):
    """``--search-nodes``: plans layouts at 1..``max_nodes`` nodes (``node_search.py``).
    torch.distributed must be set up for one process, as for ``make_plan``."""
    from engram_train.memory_plan.node_search import search_nodes, with_layout
    from engram_train.training.run_config import ConfigError, backbone_model

    cache: dict = {"searching": True}
    if vocab is None:
        from engram_train.data import load_tokenizer

        vocab = load_tokenizer(cfg.data.tokenizer).vocab_size

    def plan_at(layout_cfg, world):
        return make_plan(layout_cfg, world, nproc_per_node, vocab, device, device_memory,
                         host_memory, baseline, cache=cache)

    backbone = backbone_model(cfg)
    try:
        plan = search_nodes(cfg, max_nodes, nproc_per_node, plan_at, int(backbone["num_layers"]),
                            int(backbone["num_moe_experts"] or 0))
    except ConfigError as e:
        raise PlanError(f"--search-nodes={max_nodes}: {e}") from None
    lay = plan.layout  # planned again outside the search: the layout's notes
    found = with_layout(cfg, {"tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "eps": lay.table_shards})
    cache["searching"] = False
    plan.notes = plan_at(found, lay.world).notes
    return plan
