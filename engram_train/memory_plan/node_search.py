"""``--search-nodes N``: the smallest node count <= N at which the configuration fits.

How the layout scales with the node count (docs/memory.md 'Searching the node count'): the
parallel sizes the config sets above 1 are kept; those left at 1 are derived for each node
count ``n`` (world ``W = n x nproc_per_node``):

- TP in 1, 2, 4, ... up to the GPUs of a node (tensor parallelism stays inside a node);
- PP in 1, 2, 4, 5, 8 among the divisors of the layer count;
- EP the largest divisor of the expert count that divides DP x CP (the project's rule,
  ``runtime.ParallelSizes.validate``; DeepSeek-V3's megatron experts split over EP x TP,
  DeepSeek-V4.1's over EP and replicated over TP);
- the Engram embedding-parallel size the ranks of a pipeline stage, ``W / PP`` (the tables
  split as far as they can: ``alltoall`` method only; ``allreduce`` splits them over TP);
- data parallelism the rest. CP, recompute, batch sizes and everything else are the config's.

Node counts are tried from 1 up; at each, the layouts in the order of TP x PP (then TP), and
the first layout whose plan fits (``fits: yes``, the plan's measured margin included) is the
answer. When none fits with the margin, the answer is the smallest count at which a layout
fits as planned (``tight``), else the layout at N with the smallest device peak; ``fits`` is
then false and ``search`` says so.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from engram_train.config import resolve

PIPELINE_SIZES = (1, 2, 4, 5, 8)


def _largest_divisor(n: int, of: int) -> int:
    """The largest divisor of ``n`` that divides ``of`` (at least 1)."""
    return max((d for d in range(1, n + 1) if n % d == 0 and of % d == 0), default=1)


def candidates(cfg, world: int, nproc_per_node: int, num_layers: int, num_experts: int) -> list[dict]:
    """The layouts tried at ``world`` ranks, in order: system/model overrides per layout."""
    s = cfg.system
    tp_set, pp_set = int(s.tensor_model_parallel_size), int(s.pipeline_model_parallel_size)
    cp = int(s.context_parallel_size or 1)
    ep_set = int(s.expert_model_parallel_size)
    eps_set = int(resolve(cfg.model)["engram_embedding_parallel_size"])
    tps = [tp_set] if tp_set > 1 else [t for t in (1, 2, 4, 8, 16) if t <= nproc_per_node]
    pps = [pp_set] if pp_set > 1 else [p for p in PIPELINE_SIZES if num_layers % p == 0]
    out = []
    for tp in tps:
        for pp in pps:
            if world % (tp * pp * cp):
                continue
            dp = world // (tp * pp * cp)
            if cfg.train.global_batch_size % (cfg.train.micro_batch_size * dp):
                continue  # the batch does not split over dp (validate_run_config's rule)
            ep = ep_set if ep_set > 1 or not num_experts else _largest_divisor(num_experts, dp * cp)
            eps = eps_set if eps_set > 1 else world // pp
            out.append({"tp": tp, "pp": pp, "ep": ep, "eps": eps})
    out.sort(key=lambda c: (c["tp"] * c["pp"], c["tp"]))
    return out


def with_layout(cfg, c: dict, new=None):
    """A copy of ``cfg`` with layout ``c`` (``new``: a copy made before, set again in place)."""
    new = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False)) if new is None else new
    new.system.tensor_model_parallel_size = c["tp"]
    new.system.pipeline_model_parallel_size = c["pp"]
    new.system.expert_model_parallel_size = c["ep"]
    if new.model.get("use_engram", False):
        OmegaConf.set_struct(new.model, False)
        new.model.engram_embedding_parallel_size = c["eps"]
    return new


def search_nodes(cfg, max_nodes: int, nproc_per_node: int, plan_at, num_layers: int,
                 num_experts: int):
    """The plan at the smallest node count <= ``max_nodes`` that fits (module docstring).
    ``plan_at(cfg, world)`` plans one layout (raising ``ConfigError`` for one it refuses);
    ``ConfigError`` when no layout is valid."""
    from engram_train.training.run_config import ConfigError

    tight = best = work = refused = None
    tried = 0
    for nodes in range(1, max_nodes + 1):
        world = nodes * nproc_per_node
        for c in candidates(cfg, world, nproc_per_node, num_layers, num_experts):
            try:
                work = with_layout(cfg, c, work)
                plan = plan_at(work, world)
            except ConfigError as e:
                refused = e
                continue
            tried += 1
            if plan.verdict == "yes":
                plan.search = (f"the smallest node count <= {max_nodes} that fits; {tried} layouts "
                               "planned (docs/memory.md 'Searching the node count')")
                return plan
            if plan.verdict == "tight" and tight is None:
                tight = plan
            if nodes == max_nodes and (best is None or plan.device_bytes_per_rank < best.device_bytes_per_rank):
                best = plan
    plan = tight or best
    if plan is None:
        why = refused or ("train.global_batch_size does not split into micro-batches over any "
                          "of their data-parallel sizes")
        raise ConfigError(f"no layout of 1 to {max_nodes} nodes of {nproc_per_node} ranks is valid: {why}")
    what = ("the smallest node count at which a layout fits as planned, not with the plan's "
            "margin" if plan is tight else "no node count fits; the layout at the largest count "
            "with the smallest device peak")
    plan.search = f"none <= {max_nodes} fits with the margin: {what}; {tried} layouts planned"
    return plan
