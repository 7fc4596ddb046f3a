"""The plan of a run: bytes per rank kind (pipeline stage), whether it fits, and what to change.

Every item is ``(name, memory, phase, bytes)``: ``memory`` is "device" or "host"; ``phase`` is
"persistent" (held for the whole run) or the transient phase it belongs to ("step": forward and
backward of the in-flight micro-batches; "optimizer": the optimizer step; "save": a checkpoint
save). A rank's peak in a memory is its persistent items plus its largest transient phase: the
phases do not overlap. On the CPU (``device="cpu"``) device and host are one memory and
``total_bytes_per_rank`` is the predicted peak RSS of a rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engram_train.memory_plan import activations, cpu_heap, engram_tables, fixed, optimizer_bytes
from engram_train.models.families import family_of
from engram_train.memory_plan.plan_layout import Layout
from engram_train.memory_plan.model_bytes import StageParams, grad_buffer_bytes, weight_bytes

PHASES = ("step", "optimizer", "save")

FIT_MARGIN = 0.20
"""``fits: yes`` needs every prediction raised by this much to fit: the plan's largest measured
under-prediction of peak RSS plus the 5% by which runs of one configuration differ
(docs/memory.md, the held-out tables of benchmarks/measure_memory_plan.py: 1727 / 1509 MiB =
1.144, a bf16 MoE run at hidden 96 whose kernel caches filled above the fitted curve; 49
configurations, 66 ranks, none under by more; before the heap holes were counted the largest
was 1.194). Between the prediction and the prediction plus the margin the plan says
``tight``."""

# What changes an item, by the start of its name: the fields a user would turn.
ADVICE = {
    "weights": "system.tensor_model_parallel_size, system.pipeline_model_parallel_size, "
               "system.expert_model_parallel_size, system.precision=bf16",
    "grad_buffer": "system.tensor_model_parallel_size, system.pipeline_model_parallel_size, "
                   "system.expert_model_parallel_size",
    "adam_moments": "system.use_distributed_optimizer=true, more data-parallel ranks (--nnodes)",
    "fp32_main_params": "system.use_distributed_optimizer=true, more data-parallel ranks (--nnodes)",
    "optimizer_step": "system.tensor_model_parallel_size, system.expert_model_parallel_size",
    "engram_table": "model.engram_embedding_parallel_size, model.engram_table_placement=host, "
                    "model.engram_offload_embedding_optimizer_states=true, "
                    "model.engram_table_dtype=bf16, model.engram_vocab_size",
    "engram_gradient_rows": "train.micro_batch_size, train.seq_length",
    "attention_score_transients": "train.micro_batch_size, train.seq_length, system.tensor_model_parallel_size",
    "attention_scores": "system.recompute_granularity, train.micro_batch_size, train.seq_length",
    "attention": "system.recompute_granularity, train.micro_batch_size, "
                 "system.tensor_model_parallel_size (+ sequence_parallel), system.context_parallel_size",
    "dense_mlp": "system.recompute_granularity, train.micro_batch_size, system.tensor_model_parallel_size",
    "moe": "system.recompute_granularity, train.micro_batch_size, system.tensor_model_parallel_size",
    "engram": "system.recompute_granularity, train.micro_batch_size",
    "mhc": "system.recompute_granularity (full), train.micro_batch_size",
    "layer_inputs": "train.micro_batch_size, system.pipeline_model_parallel_size, system.context_parallel_size",
    "backward_working_set": "train.micro_batch_size, system.tensor_model_parallel_size",
    "embedding_output": "train.micro_batch_size",
    "logits_and_loss": "train.micro_batch_size, system.tensor_model_parallel_size",
    "prefetch": "data.hash_prefetch=false, train.micro_batch_size",
    "checkpoint_save": "checkpoint.save_interval (saves are transient), system.use_distributed_optimizer=true",
    "process_baseline": "--nproc-per-node (fewer ranks per node)",
    "cpu_bf16_moe_kernel_cache": "system.precision=fp32 (CPU runs)",
    "cpu_heap_holes": "train.micro_batch_size, train.seq_length (CPU runs)",
}


def advice(name: str) -> str:
    for prefix, fields in ADVICE.items():
        if name.startswith(prefix):
            return fields
    return ""


@dataclass
class RankPlan:
    """One rank kind: the ranks of pipeline stage ``stage``."""

    stage: int
    layers: list[int]
    items: list[tuple[str, str, str, int]] = field(default_factory=list)

    def add(self, name: str, memory: str, phase: str, nbytes: int) -> None:
        if nbytes:
            self.items.append((name, memory, phase, int(nbytes)))

    def peak(self, memory: str, exclude: tuple[str, ...] = ()) -> int:
        """Persistent bytes plus the largest transient phase (items in ``exclude`` left out)."""
        items = [(m, p, b) for n, m, p, b in self.items if m == memory and n not in exclude]
        persistent = sum(b for _, p, b in items if p == "persistent")
        transient = [sum(b for _, p, b in items if p == phase) for phase in PHASES]
        return persistent + max(transient)

    def breakdown(self) -> dict:
        out: dict = {"stage": self.stage, "layers": [min(self.layers), max(self.layers)] if self.layers else [],
                     "device_bytes": self.peak("device"), "host_bytes": self.peak("host"), "items": {}}
        for name, memory, phase, nbytes in self.items:
            out["items"][name] = {"memory": memory, "phase": phase, "bytes": nbytes}
        return out


def plan_stage(config, layout: Layout, sp: StageParams, layers: list[int], precision: str,
               vocab: int, device: str, save: bool, cpu_baseline: int | None) -> RankPlan:
    rp = RankPlan(sp.stage, layers)
    a = 2 if precision in ("bf16", "fp16") else 4
    for name, nbytes in weight_bytes(sp, precision, "").items():
        rp.add(name, "device", "persistent", nbytes)
    rp.add("grad_buffer_fp32", "device", "persistent", grad_buffer_bytes(sp))
    opt = optimizer_bytes.optimizer_state_bytes(sp, layout, precision)
    for name, nbytes in opt.items():
        rp.add(name, "device", "persistent", nbytes)
    rp.add("optimizer_step", "device", "optimizer", optimizer_bytes.optimizer_step_bytes(sp))

    tables = sp.params.get("engram_tables", 0)
    engram_layers = [i for i in layers if config.use_engram and i in config.engram_layer_ids]
    k = (config.max_ngram_size - 1) * config.n_head_per_ngram if engram_layers else 0
    touched = min(layout.tokens * layout.num_micro * k * len(engram_layers), sp.table_rows)
    table_state = 0
    for name, memory, nbytes in engram_tables.table_items(config, tables, touched):
        phase = {"engram_table_step": "optimizer", "engram_gradient_rows": "optimizer"}.get(name, "persistent")
        rp.add(name, memory, phase, nbytes)
        if phase == "persistent" and name != f"engram_tables_{config.engram_table_dtype}":
            table_state += nbytes

    step = activations.stage_activations(config, layout, sp.stage, layers, a, vocab, device)
    for name, nbytes in step.items():
        rp.add(name, "device", "step", nbytes)
    rp.add("prefetch_buffers", "host", "persistent", activations.prefetch_bytes(config, layout))

    if save:  # megatron's optimizer state is copied into the save's sharded state dict
        state = sum(opt.values()) + table_state
        if device == "cpu":
            rp.add("checkpoint_save_copies", "host", "save", state)
        else:  # everything goes through host memory on its way to the files
            weights = sum(b for n, m, p, b in rp.items if n.startswith(("weights", "engram_tables_")))
            rp.add("checkpoint_save_copies", "host", "save", state + weights)

    allocated = rp.peak("device")
    for name, nbytes in fixed.device_fixed_items(device, allocated):
        rp.add(name, "device", "persistent", nbytes)
    for name, nbytes in fixed.host_fixed_items(device, cpu_baseline):
        rp.add(name, "host", "persistent", nbytes)
    terms = family_of(config).plan  # the family's own terms (DeepSeek-V4.1's), or None
    kinds = None if terms is not None else activations.layer_kinds(config)
    moe_layers = sum(1 for i in layers if kinds is None or kinds[i] == "moe")
    batches = None
    if layout.train_iters and config.num_moe_experts:
        batches = layout.train_iters * layout.num_micro * moe_layers * (config.num_moe_experts // layout.ep)
    tokens = layout.micro_batch_size * layout.seq_length
    for name, nbytes in fixed.cpu_runtime_items(device, precision, batches, sp.group("expert") > 0, tokens):
        rp.add(name, "host", "persistent", nbytes)
    if device == "cpu":
        passes = layout.train_iters * layout.num_micro if layout.train_iters else None
        fraction = (terms.cpu_heap_hole_fraction if terms is not None
                    else cpu_heap.CPU_HEAP_HOLE_FRACTION)
        holes = cpu_heap.heap_hole_bytes(step, activations.single_tensor_bytes(config, layout, vocab, device),
                                         passes, fraction)
        rp.add("cpu_heap_holes", "host", "persistent", holes)
    return rp


def _gib(n: int) -> str:
    return f"{n / (1 << 30):8.2f} GiB"


@dataclass
class Plan:
    layout: Layout
    device: str
    device_memory: int | None
    host_memory: int | None
    ranks: list[RankPlan]
    notes: list[str] = field(default_factory=list)
    search: str | None = None  # how --search-nodes found the node count (node_search.py)

    @property
    def device_bytes_per_rank(self) -> int:
        return max(r.peak("device") for r in self.ranks)

    @property
    def host_bytes_per_rank(self) -> int:
        return max(r.peak("host") for r in self.ranks)

    @property
    def total_bytes_per_rank(self) -> int:
        return max(r.peak("device") + r.peak("host") for r in self.ranks)

    @property
    def host_bytes_per_node(self) -> int:
        per_rank = self.total_bytes_per_rank if self.device == "cpu" else self.host_bytes_per_rank
        return per_rank * self.layout.nproc_per_node

    def _checks(self) -> list[tuple[str, int, int]]:
        """(memory, predicted bytes, available bytes) of each memory with a size given."""
        out = []
        if self.device != "cpu" and self.device_memory is not None:
            out.append(("device", self.device_bytes_per_rank, self.device_memory))
        if self.host_memory is not None:
            out.append(("host", self.host_bytes_per_node, self.host_memory))
        return out

    def problems(self, margin: float = 0.0) -> list[str]:
        """The memories whose prediction, raised by ``margin``, exceeds what is available."""
        out = []
        for memory, predicted, available in self._checks():
            if predicted * (1 + margin) > available:
                where = "per rank" if memory == "device" else "per node"
                raised = f" (+{margin:.0%}: {_gib(int(predicted * (1 + margin))).strip()})" if margin else ""
                out.append(f"{memory}: {_gib(predicted).strip()}{raised} {where} > {_gib(available).strip()}")
        return out

    @property
    def verdict(self) -> str:
        """``yes``: every prediction plus the measured error (``FIT_MARGIN``) fits; ``no``: a
        prediction alone does not; ``tight``: in between (it fits only if the plan is not
        under by as much as it has been measured to be)."""
        if self.problems():
            return "no"
        return "tight" if self.problems(FIT_MARGIN) else "yes"

    @property
    def fits(self) -> bool:
        return self.verdict == "yes"

    def largest(self, n: int = 5) -> list[dict]:
        """The largest items of the rank kind that needs the most, with their fields."""
        problems = self.problems(FIT_MARGIN)
        memory = "host" if problems and not problems[0].startswith("device") else "device"
        if self.device == "cpu":
            rank = max(self.ranks, key=lambda r: r.peak("device") + r.peak("host"))
        else:
            rank = max(self.ranks, key=lambda r: r.peak(memory))
        items = [(name, m, b) for name, m, p, b in rank.items if self.device == "cpu" or m == memory]
        items.sort(key=lambda x: -x[2])
        return [{"item": name, "memory": m, "bytes": b, "stage": rank.stage, "change": advice(name)}
                for name, m, b in items[:n]]

    def to_json(self) -> dict:
        lay = self.layout
        out = {
            "device": self.device, "fits": self.fits, "fits_verdict": self.verdict,
            "fit_margin": FIT_MARGIN, "problems": self.problems(FIT_MARGIN),
            "device_bytes_per_rank": self.device_bytes_per_rank,
            "host_bytes_per_rank": self.host_bytes_per_rank,
            "host_bytes_per_node": self.host_bytes_per_node,
            "device_memory": self.device_memory, "host_memory": self.host_memory,
            "layout": {"world": lay.world, "nproc_per_node": lay.nproc_per_node, "tp": lay.tp,
                       "pp": lay.pp, "vpp": lay.vpp, "ep": lay.ep, "cp": lay.cp, "dp": lay.dp,
                       "expert_dp": lay.expert_dp, "table_shards": lay.table_shards,
                       "micro_batches": lay.num_micro},
            "breakdown": {f"stage{r.stage}": r.breakdown() for r in self.ranks},
            "nodes": lay.world // lay.nproc_per_node,
        }
        if self.notes:
            out["notes"] = self.notes
        if self.search:
            out["search"] = self.search
        if self.device == "cpu":
            out["total_bytes_per_rank"] = self.total_bytes_per_rank
        if not self.fits:
            out["largest"] = self.largest()
        return out

    def to_text(self) -> str:
        lay = self.layout
        lines = [f"engram-plan: {lay.world} ranks ({lay.nproc_per_node} per node): TP {lay.tp}, PP {lay.pp}"
                 f"{f' (VPP {lay.vpp})' if lay.vpp else ''}, EP {lay.ep}, CP {lay.cp}, DP {lay.dp}, "
                 f"Engram table shards {lay.table_shards}, {lay.num_micro} micro-batches of "
                 f"{lay.micro_batch_size} x {lay.seq_length} per step; device: {self.device}"]
        for r in self.ranks:
            first, last = (min(r.layers), max(r.layers)) if r.layers else ("-", "-")
            lines.append(f"\nstage {r.stage} (layers {first}-{last}): device {_gib(r.peak('device')).strip()}, "
                         f"host {_gib(r.peak('host')).strip()}")
            for memory in ("device", "host"):
                for name, m, phase, nbytes in sorted(r.items, key=lambda x: -x[3]):
                    if m == memory:
                        lines.append(f"  {memory:6} {phase:10} {name:34} {_gib(nbytes)}")
        lines.append("")
        if self.device == "cpu":
            lines.append(f"per rank (peak RSS): {_gib(self.total_bytes_per_rank).strip()}; per node: "
                         f"{_gib(self.host_bytes_per_node).strip()}"
                         + (f" of {_gib(self.host_memory).strip()}" if self.host_memory else ""))
        else:
            lines.append(f"device per rank: {_gib(self.device_bytes_per_rank).strip()}"
                         + (f" of {_gib(self.device_memory).strip()}" if self.device_memory else "")
                         + f"; host per node: {_gib(self.host_bytes_per_node).strip()}"
                         + (f" of {_gib(self.host_memory).strip()}" if self.host_memory else ""))
        if self.search:
            lines.append(f"nodes: {lay.world // lay.nproc_per_node} ({self.search})")
        lines.extend(f"note: {note}" for note in self.notes)
        if self.verdict == "yes":
            lines.append(f"fits: yes (with the plan's measured error, +{FIT_MARGIN:.0%})")
        elif self.verdict == "tight":
            lines.append(f"fits: tight (fits as planned, not with the plan's measured error: "
                         + "; ".join(self.problems(FIT_MARGIN)) + ")")
        else:
            lines.append("fits: NO (" + "; ".join(self.problems()) + ")")
            lines.append("largest items and the fields that change them:")
            for item in self.largest():
                lines.append(f"  {item['item']} ({item['memory']}, stage {item['stage']}): "
                             f"{_gib(item['bytes']).strip()} <- {item['change']}")
        return "\n".join(lines)
