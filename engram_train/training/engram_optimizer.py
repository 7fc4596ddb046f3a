"""The Engram table optimizer: its own parameter group, outside megatron's DDP and optimizer.

Why a separate optimizer. megatron DDP averages every gradient in its buffers over megatron's
data-parallel group. A table shard's replicas are not megatron's DP peers: with method
``alltoall`` the rows are split over the Engram embedding-parallel group, so e.g. under
TP1 x eps4 the four megatron DP peers own four different row blocks and averaging their
gradients would mix unrelated rows. The tables therefore stay out of megatron's DDP and
optimizer (``models/builder.py``, ``training/optimizer.py``) and are stepped here.

Cost model. A step touches the rows its tokens hash to, so nothing here is sized by the table
when ``engram_optimizer: sparse_adam``: the optimizer *arms* each table for row-sparse
gradients (``engram/row_grad.py``), lookups deliver (rows, gradient rows) pairs, and the
step coalesces, reduces, clips and applies them row by row. ``adam`` (dense Adam, the paper's
recipe) uses the same gradient route and densifies only for its step, which moves every row.

The hook: ``EngramTableOptimizer`` is a megatron ``MegatronOptimizer`` chained after megatron's
own optimizers in a ``ChainedOptimizer``, so ``train_step``'s ``optimizer.step()``, the LR
scheduler (``param_groups`` carry ``max_lr``/``min_lr``/``wd_mult`` like megatron's groups) and
``engram_train.checkpoint`` drive it unchanged. In ``ChainedOptimizer.step``:

1. ``prepare_grads`` - each table's row pairs are coalesced (distinct rows, float32 sums),
   scaled by 1 / megatron's data-parallel(x context) size and summed over the method's
   ``grad_sync_group`` (the Engram data-parallel group for ``alltoall``, megatron's DP group
   for ``allreduce``) by ``parallel/row_grad_sync.py``: an all-gather of the touched rows, or a
   dense all-reduce when that moves fewer bytes; replicas end bitwise equal. The result equals
   the single-rank gradient of the global batch, as megatron DDP's average does for every other
   parameter.
2. ``get_grad_norm`` - the table group differs from megatron's grad-stats group, so the chain
   takes sqrt(sum of squares) of each optimizer's global norm. Ours sums squares of the synced
   gradient rows over the method's ``norm_group`` (embedding-parallel ranks x pipeline stages
   with one Engram data-parallel rank; TP x PP with one DP rank for ``allreduce``): each
   touched row once, never a TP duplicate or a DP replica; untouched rows contribute zero, so
   this is the dense norm.
3. the chain clips every optimizer's ``get_parameters()`` grads with the combined norm: ours
   returns one *grad carrier* per table, a zero-stride float32 view shaped like the synced
   gradient rows (no memory) whose ``.grad`` is those rows, so the clip scales them in place.
4. ``step_with_ready_grads`` - ``sparse_adam``: ``RowSparseAdam`` (``training/sparse_adam.py``)
   on the touched rows of the float32 masters, then those rows are copied to the table.
   ``adam``: the rows are scattered into a dense float32 gradient and torch AdamW steps the
   whole shard. ``engram_weight_decay`` is decoupled (AdamW's) for every table optimizer.

Masters: a float32 table is its own master (no copy); a bf16 table gets a float32 master.
Optimizer-state offload (``engram_offload_embedding_optimizer_states``): masters and Adam
moments live in host memory (masters pinned when the table is on a CUDA device) and the update
runs on the CPU. With ``sparse_adam`` only the touched rows cross: gradient rows down, updated
rows up; with ``adam`` the dense gradient is built on the host and the whole shard goes up.
On a host without CUDA, offload keeps separate masters and runs the same copies.
Host-resident tables (``engram_table_placement: host``, ``engram/host_table.py``): the tables
themselves, hence their masters and moments, live in host memory; gradient rows are synced on
the compute device (sparse route only: never a table-sized buffer) and the step runs on the
host (offload is implied and adds nothing).

Checkpoints (``training/table_optimizer_state.py``): the same keys for both element-wise
optimizers and with or without offload (dense moments per table, float32 masters under bf16
only), so a run may switch between them or offload on resume.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.optimizer.optimizer import MegatronOptimizer

from engram_train.engram.host_table import HOST_TABLE_TIMES, is_host_resident
from engram_train.engram.row_grad import arm_row_sparse_grad
from engram_train.errors import ConfigError
from engram_train.parallel.row_grad_sync import RowGradSyncStats, sync_row_grads
from engram_train.runtime.distributed import device as runtime_device
from engram_train.runtime.optimizer_chain import ENGRAM_CHAIN_ROLE
from engram_train.training.host_update import OverlappedHostUpdate
from engram_train.training.rowwise_adam import RowwiseAdam
from engram_train.training.sparse_adam import RowOptimizer, RowSparseAdam
from engram_train.training.table_optimizer_state import (  # noqa: F401 - the layouts' home
    ELEMENTWISE_STATE,
    ROWWISE_STATE,
    TableOptimizerState,
)

if TYPE_CHECKING:
    from engram_train.config.composed import ModelConfig


def engram_table_param_group(opt_config: OptimizerConfig, model_config: ModelConfig) -> dict:
    """Hyper-parameters of the table group, in megatron's param-group vocabulary: the LR
    scheduler reads ``max_lr``/``min_lr`` (base x ``engram_lr_multiplier``) and ``wd_mult``."""
    mult = float(model_config.engram_lr_multiplier)
    wd = float(model_config.engram_weight_decay)
    if wd and not opt_config.weight_decay:
        raise ConfigError(
            f"engram_weight_decay={wd} needs a non-zero optimizer weight_decay: the scheduler "
            "sets each group's weight decay as weight_decay x wd_mult. Set the optimizer's "
            "weight_decay or engram_weight_decay: 0."
        )
    return {
        "lr": opt_config.lr * mult,
        "weight_decay": wd,
        "max_lr": opt_config.lr * mult,
        "min_lr": (opt_config.min_lr or 0.0) * mult,
        "wd_mult": wd / opt_config.weight_decay if opt_config.weight_decay else 0.0,
        "lr_mult": 1.0,
        "is_expert_parallel": False,
        "is_decoupled_lr": False,
        "default_config": False,
        "is_engram_table": True,
    }


def _row_sparse_adam(group: dict, config: OptimizerConfig, offload: bool,
                     **options) -> torch.optim.Optimizer:
    """``sparse_adam``: lazy row-wise Adam (``sparse_adam.py``), a step costs the rows touched."""
    return RowSparseAdam([group], lr=group["lr"], betas=(config.adam_beta1, config.adam_beta2),
                         eps=config.adam_eps, weight_decay=group["weight_decay"])


def _rowwise_adam(group: dict, config: OptimizerConfig, offload: bool, *, state_dtype: str = "fp32",
                  seed: int = 0) -> torch.optim.Optimizer:
    """``rowwise_adam``: sparse Adam with one second moment per row (``rowwise_adam.py``)."""
    return RowwiseAdam([group], lr=group["lr"], betas=(config.adam_beta1, config.adam_beta2),
                       eps=config.adam_eps, weight_decay=group["weight_decay"],
                       state_dtype=state_dtype, seed=seed)


def _dense_adam(group: dict, config: OptimizerConfig, offload: bool,
                **options) -> torch.optim.Optimizer:
    """``adam``: torch's dense AdamW, a step costs the whole table (the reference). Weight decay
    is decoupled whatever megatron's ``decoupled_weight_decay``, as the row-sparse optimizers
    apply it: one ``engram_weight_decay`` means one update."""
    return torch.optim.AdamW(
        [group], lr=group["lr"], weight_decay=group["weight_decay"],
        betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
        # Host tensors: torch would pick its single-tensor loop; foreach is the same
        # algorithm as its CUDA default (and bitwise equal to the loop on CPU).
        **({"foreach": True} if offload else {}),
    )


# ``engram_optimizer`` -> the torch optimizer stepping the tables (names: config.TABLE_OPTIMIZERS)
TABLE_OPTIMIZER_BUILDERS = {"sparse_adam": _row_sparse_adam, "adam": _dense_adam,
                            "rowwise_adam": _rowwise_adam}

class EngramTableOptimizer(TableOptimizerState, MegatronOptimizer):
    """Adam (dense) or lazy row-wise Adam over this rank's Engram table shards; see the module
    docstring.

    ``table_params`` may be empty (a pipeline stage without Engram layers): the optimizer still
    joins the collectives of the grad norm so every rank makes the same calls.
    """

    chain_role = ENGRAM_CHAIN_ROLE  # its state's key in a checkpoint's optimizer chain

    def __init__(
        self,
        config: OptimizerConfig,
        table_params: list[torch.nn.Parameter],
        param_group: dict,
        grad_sync_group: dist.ProcessGroup,
        norm_group: dist.ProcessGroup,
        calculate_per_token_loss: bool = False,
        offload_states: bool = False,
        *,
        table_optimizer: str,
        master_weights: bool = True,
        state_dtype: str = "fp32",
        seed: int = 0,
        overlap_host_update: bool = False,
    ) -> None:
        if config.fp16:
            raise NotImplementedError(
                "Engram tables with fp16 loss scaling are not supported: train in bf16 or fp32."
            )
        if config.optimizer != "adam":
            raise ConfigError(
                "Engram tables are trained with Adam (paper recipe); "
                f"optimizer={config.optimizer!r} is not supported with use_engram."
            )
        if calculate_per_token_loss:
            raise NotImplementedError(
                "calculate_per_token_loss with Engram tables: table gradients would miss "
                "finalize_model_grads' 1/num_tokens scaling. Use the default per-micro-batch mean."
            )
        self.model_params = list(table_params)
        self.grad_sync_group = grad_sync_group
        self.grad_stats_parallel_group = norm_group
        self.table_optimizer = table_optimizer
        self.sparse = table_optimizer != "adam"  # the config validated the name
        self.num_steps = 0
        # float32 masters of low-precision tables (none with master_weights=False: the
        # optimizer rounds the bf16 values stochastically itself)
        self.mixed_precision = master_weights and any(
            p.dtype != torch.float32 for p in self.model_params)
        # Host-resident tables keep their state in host memory already: offload adds nothing.
        self.host_tables = any(is_host_resident(p) for p in self.model_params)
        self.offload = bool(offload_states) and not self.host_tables
        self.overlap = (self.host_tables and overlap_host_update and self.sparse
                        and all(p.device.type == "cpu" for p in self.model_params))
        self.host_update = OverlappedHostUpdate() if self.overlap else None
        self.accumulators = [arm_row_sparse_grad(p) for p in self.model_params]
        self._row_grads: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._carriers: list[torch.Tensor] = []
        self.last_sync: RowGradSyncStats | None = None
        if self.offload or self.mixed_precision:
            self.main_params = [self._new_master(p, self.offload) for p in self.model_params]
        else:
            self.main_params = self.model_params
        group = dict(param_group, params=self.main_params)
        optimizer = TABLE_OPTIMIZER_BUILDERS[table_optimizer](
            group, config, self.offload, state_dtype=state_dtype, seed=seed)
        super().__init__(optimizer, config, init_state_fn=self._init_state)
        self.is_stub_optimizer = False
        self._scale = torch.ones(1, dtype=torch.float32, device=runtime_device())

    @staticmethod
    @torch.no_grad()
    def _new_master(param: torch.nn.Parameter, offload: bool) -> torch.nn.Parameter:
        """float32 master of a table: in host memory with offload (pinned for a CUDA table, so
        row copies can be asynchronous), next to the table otherwise."""
        pin = offload and param.device.type == "cuda"
        device = "cpu" if offload else param.device
        master = torch.empty(param.shape, dtype=torch.float32, device=device, pin_memory=pin)
        master.copy_(param.detach())
        master = torch.nn.Parameter(master)
        for name in ("engram_layer_id", "engram_row_start"):  # they key stochastic rounding
            if hasattr(param, name):
                setattr(master, name, getattr(param, name))
        return master

    # -- gradients -----------------------------------------------------------------------

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Coalesce each table's row pairs, scale by 1 / DP and sum over the grad-sync group."""
        if self.host_update is not None:  # a failed overlapped update stops before any collective
            self.host_update.check()
        scale = 1.0 / parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        local = []
        for param, accumulator in zip(self.model_params, self.accumulators):
            if param.grad is not None:  # a lookup outside the armed path: never silently drop
                raise RuntimeError(
                    f"Engram table of layer {getattr(param, 'engram_layer_id', '?')} got a dense "
                    ".grad: table lookups must go through MultiHeadEmbedding (row-sparse)."
                )
            # gradient rows stay on the compute device (the sync runs there), host tables too
            rows, values = accumulator.coalesce(
                runtime_device() if is_host_resident(param) else param.device)
            local.append((rows, values.mul_(scale)))
        self._row_grads, self.last_sync = sync_row_grads(
            local, [p.shape[0] for p in self.model_params], self.grad_sync_group,
            dense_allowed=[not is_host_resident(p) for p in self.model_params])
        self._carriers = []
        for _, values in self._row_grads:
            carrier = torch.zeros((), dtype=torch.float32, device=values.device)
            carrier = carrier.expand(values.shape)
            carrier.grad = values
            self._carriers.append(carrier)
        return False

    def row_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The synced (rows, float32 gradient rows) of each table this step (after
        ``prepare_grads``; clipped in place by the chain's clip)."""
        if self._row_grads is None:
            raise RuntimeError("row_grads() before prepare_grads()")
        return self._row_grads

    def dense_grad(self, index: int) -> torch.Tensor:
        """Table ``index``'s synced gradient as a dense [rows, D] float32 tensor (inspection)."""
        rows, values = self.row_grads()[index]
        dense = values.new_zeros((self.model_params[index].shape[0], values.shape[1]))
        return dense.index_copy_(0, rows, values)

    def get_parameters(self) -> list[torch.Tensor]:
        """The grad carriers of this step (module docstring) once grads are prepared; the
        tensors Adam steps otherwise (without a ``.grad``: nothing to clip)."""
        return list(self._carriers) if self._row_grads is not None else list(self.main_params)

    def get_main_grads_for_grad_norm(self) -> list[torch.Tensor]:
        # Shards are disjoint within the norm group: no TP-duplicate filtering (megatron's
        # default would drop every TP rank but the first).
        if self._row_grads is None:
            return []
        return [values for _, values in self._row_grads]

    def get_grads_for_grad_norm(self, grad_norm_group: str | None = None) -> list[torch.Tensor]:
        # megatron-core >= 0.19's name for the hook above (ChainedOptimizer.get_grad_norm calls
        # it when the grad-stats groups are shared); its default would filter our gradient rows
        # as TP duplicates. No parameter here belongs to a separate grad-norm group.
        return self.get_main_grads_for_grad_norm() if grad_norm_group is None else []

    def get_grad_stats_parallel_group(self) -> dist.ProcessGroup:
        return self.grad_stats_parallel_group

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        return get_grad_norm_fp32(
            self.get_main_grads_for_grad_norm(),
            grad_stats_parallel_group=self.grad_stats_parallel_group,
        )

    @torch.no_grad()
    def count_zeros(self) -> float:
        """Zero gradient entries of the shards, untouched rows included (as a dense count)."""
        zeros = torch.zeros(1, dtype=torch.float32, device=self._scale.device)
        for param, (rows, values) in zip(self.model_params, self._row_grads or []):
            zeros += (values == 0).sum() + (param.shape[0] - rows.numel()) * param.shape[1]
        dist.all_reduce(zeros, group=self.grad_stats_parallel_group)
        return zeros.item()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param, accumulator in zip(self.model_params, self.accumulators):
            param.grad = None
            accumulator.clear()
        for main in self.main_params:
            main.grad = None
        self._row_grads = None
        self._carriers = []

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale

    # -- step ----------------------------------------------------------------------------

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        grads = self._row_grads
        if grads is None:  # no prepare_grads this step: nothing was looked up
            grads = [(torch.empty(0, dtype=torch.int64, device=p.device),
                      torch.empty((0, p.shape[1]), device=p.device)) for p in self.model_params]
        if self.overlap:
            self.host_update.finish()  # counts its own wait as critical path
        start = time.perf_counter()
        if self.overlap:
            self._launch_overlapped_step(grads)
            HOST_TABLE_TIMES.wait_s += time.perf_counter() - start  # launching it
        elif self.sparse:
            self._sparse_step(grads)
        else:
            self._dense_step(grads)
        if self.host_tables and not self.overlap:
            elapsed = time.perf_counter() - start
            HOST_TABLE_TIMES.update_s += elapsed
            HOST_TABLE_TIMES.wait_s += elapsed  # synchronous: all of it on the critical path
        self.num_steps += 1
        return True

    def _sparse_step(self, grads) -> None:
        """Row-sparse Adam on the touched rows of the masters; those rows are copied to the
        table."""
        master_grads = [(rows.to(main.device), values.to(main.device))
                        for (rows, values), main in zip(grads, self.main_params)]
        self.optimizer.step_rows(master_grads)
        for index, (rows, _) in enumerate(master_grads):
            self._copy_master_rows(index, rows)

    def _copy_master_rows(self, index: int, rows: torch.Tensor) -> None:
        param, main = self.model_params[index], self.main_params[index]
        if main is not param and rows.numel():
            updated = main.data.index_select(0, rows.to(main.device)).to(param.dtype)
            param.data.index_copy_(0, rows.to(param.device), updated.to(param.device))

    def _launch_overlapped_step(self, grads) -> None:
        """Host tables: the step count and hyper-parameters advance now, the rows are updated
        by the host thread (``training/host_update.py``) while the next step starts."""
        plans = self.optimizer.begin_step()
        host = [(rows.to("cpu"), values.to("cpu")) for rows, values in grads]
        # row id -> its gradient row, for any part of the rows (a search, nothing table-sized)
        sorted_rows = [torch.sort(rows) for rows, _ in host]
        optimizer: RowOptimizer = self.optimizer

        def update(index: int, rows: torch.Tensor) -> None:
            ordered, order = sorted_rows[index]
            at = order[torch.searchsorted(ordered, rows)]
            values = host[index][1].index_select(0, at)
            optimizer.update_rows(self.main_params[index], rows, values, plans[index])
            self._copy_master_rows(index, rows)

        self.host_update.launch(self.model_params, [rows for rows, _ in host], update)

    def prioritize_rows(self, rows_per_table: list[torch.Tensor | None]) -> None:
        """Shard-local rows of each table the next step will read (None: unknown): an
        overlapped host update changes them first, so the next lookups wait least."""
        if self.overlap:
            self.host_update.prioritize(rows_per_table)

    def finish_update(self) -> None:
        """Wait for an overlapped host update in flight (no-op otherwise): call before reading
        tables or optimizer state as a whole."""
        if self.host_update is not None:
            self.host_update.finish()

    def _dense_step(self, grads) -> None:
        """Dense Adam: every row of every shard moves (momentum keeps untouched rows going)."""
        for main, (rows, values) in zip(self.main_params, grads):
            dense = torch.zeros(main.shape, dtype=torch.float32, device=main.device)
            dense.index_copy_(0, rows.to(main.device), values.to(main.device))
            main.grad = dense
        self.optimizer.step()
        for param, main in zip(self.model_params, self.main_params):
            main.grad = None
            if main is not param:
                param.data.copy_(main.data)

    @torch.no_grad()
    def step(self):
        """Standalone step (outside a ChainedOptimizer): sync, clip by our own norm, Adam."""
        self.prepare_grads()
        grad_norm = None
        if self.config.clip_grad > 0.0:
            grad_norm = self.clip_grad_norm(self.config.clip_grad)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        return self.step_with_ready_grads(), grad_norm, num_zeros

    @torch.no_grad()
    def reload_model_params(self, state_dict=None) -> None:
        self._refresh_masters_from_model()

    @torch.no_grad()
    def _refresh_masters_from_model(self) -> None:
        for param, main in zip(self.model_params, self.main_params):
            if main is not param:
                main.data.copy_(param.data)

    # -- state: checkpoints in training/table_optimizer_state.py --------------------------

    def offload_to_cpu(self) -> None:
        """megatron's RL hook; with offload the states already live in host memory."""
        if not self.offload:
            super().offload_to_cpu()

    def restore_from_cpu(self) -> None:
        """megatron's RL hook; with offload the states stay in host memory."""
        if not self.offload:
            super().restore_from_cpu()
