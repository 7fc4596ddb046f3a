"""The Engram table optimizer: its own parameter group, outside megatron's DDP and optimizer.

Why a separate optimizer. megatron DDP averages every gradient in its buffers over megatron's
data-parallel group. A table shard's replicas are not megatron's DP peers: with method
``alltoall`` the rows are split over the Engram embedding-parallel (EmbP) group, so e.g. under
TP1 x eps4 the four megatron DP peers own four different row blocks and averaging their
gradients would mix unrelated rows. The tables (also the parameters whose optimizer states go
to host memory later) therefore stay out of megatron's DDP and optimizer
(``models/builder.py``, ``training/optimizer.py``) and are stepped here.

The hook: ``EngramTableOptimizer`` is a megatron ``MegatronOptimizer`` chained after megatron's
own optimizers in a ``ChainedOptimizer``, so ``train_step``'s ``optimizer.step()``, the LR
scheduler (``param_groups`` carry ``max_lr``/``min_lr``/``wd_mult`` like megatron's groups) and
``checkpointing.py`` drive it unchanged. In ``ChainedOptimizer.step``:

1. ``prepare_grads`` (every chained optimizer) - here the grad sync: each table gradient (autograd's
   ``param.grad``; with bf16 parameters a float32 ``main_grad`` that a post-accumulate hook
   fills) is scaled by 1 / megatron's data-parallel(x context) size and summed over the method's
   ``grad_sync_group`` (EmbDP group for ``alltoall``, megatron's DP group for ``allreduce``). The
   result equals the single-rank gradient of the global batch, as megatron DDP's average does
   for every other parameter.
2. ``get_grad_norm`` - the table group differs from megatron's grad-stats group, so the chain
   takes sqrt(sum of squares) of each optimizer's global norm. Ours sums squares of the local
   shards over the method's ``norm_group`` (EmbP ranks x pipeline stages with one EmbDP rank;
   TP x PP with one DP rank for ``allreduce``): each row once, never a TP duplicate or a DP
   replica.
3. the chain clips every optimizer's ``get_parameters()`` grads with the combined norm: ours
   returns the parameters our Adam steps (float32 main copies under bf16), so tables share
   the clip factor.
4. ``step_with_ready_grads`` - torch Adam (AdamW when ``decoupled_weight_decay``, as megatron
   picks), then main -> model copy under bf16.

Optimizer-state offload (``engram_offload_embedding_optimizer_states``). The float32 master copy
of each table shard and its Adam moments live in host memory and Adam steps on the CPU; the
tables, their gradients, the grad sync, the grad norm and clipping stay on the device:

- masters: one host float32 tensor per shard (pinned when the table is on a CUDA device), a
  separate object from the table also for float32 tables; with bf16 tables a pinned host
  staging buffer in the table's dtype takes the cast master for the upload. Moments
  (``exp_avg``/``exp_avg_sq``) are ordinary host tensors: they never cross the bus.
- clipping: megatron's ``clip_grad_by_total_norm_fp32`` wants device float32 ``.grad``s, so
  ``get_parameters()`` returns device-side *grad carriers* instead of the host masters: the
  table itself for float32 tables (its ``.grad`` is the synced gradient), and under bf16 a
  zero-stride float32 view of a single device element shaped like the table (no memory),
  whose ``.grad`` is set to the synced float32 ``main_grad``. Carriers are only ever read for
  their ``.grad``; their data must not be used. With a zero-stride carrier the clip writes
  into ``main_grad``; with the table it writes into ``.grad``, exactly as without offload.
- step: clipped device grads -> pinned host buffers (async, then one wait), torch Adam/AdamW
  with the ``foreach`` implementation on the host masters (on CPU it gives the same bits as the
  default single-tensor loop), then master -> table (cast to the table's dtype; async from
  pinned memory, awaited before the host buffers are written again).
- checkpoints: the same keys as without offload (moments, float32 masters under bf16 only; a
  float32 table's master equals the table and is rebuilt from it on load), so a checkpoint
  saved with offload loads without it and vice versa.

On a host without CUDA every tensor is already a host tensor; offload still keeps separate
masters and copies grads and weights as above, so the CPU tests run the same code path.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
)
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.optimizer.optimizer import MegatronOptimizer

from engram_train.runtime.distributed import device as runtime_device


def engram_table_params(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """Engram table parameters (``is_engram_table``) of ``modules``, each once, in model order."""
    seen: dict[int, torch.nn.Parameter] = {}
    for module in modules:
        for param in module.parameters():
            if getattr(param, "is_engram_table", False):
                seen.setdefault(id(param), param)
    return list(seen.values())


@contextlib.contextmanager
def hidden_from_megatron(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """``requires_grad=False`` while megatron's DDP / optimizer collect their parameters (both
    skip frozen ones), restored after so that autograd still fills ``param.grad``."""
    previous = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(params, previous):
            p.requires_grad_(flag)


def engram_table_param_group(opt_config: OptimizerConfig, model_config: Any) -> dict:
    """Hyper-parameters of the table group, in megatron's param-group vocabulary: the LR
    scheduler reads ``max_lr``/``min_lr`` (base x ``engram_lr_multiplier``) and ``wd_mult``."""
    mult = float(model_config.engram_lr_multiplier)
    wd = float(model_config.engram_weight_decay)
    if wd and not opt_config.weight_decay:
        raise ValueError(
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


class EngramTableOptimizer(MegatronOptimizer):
    """Adam over this rank's Engram table shards; see the module docstring.

    ``table_params`` may be empty (a pipeline stage without Engram layers): the optimizer still
    joins the collectives of the grad norm so every rank makes the same calls.
    """

    def __init__(
        self,
        config: OptimizerConfig,
        table_params: list[torch.nn.Parameter],
        param_group: dict,
        grad_sync_group: dist.ProcessGroup,
        norm_group: dist.ProcessGroup,
        calculate_per_token_loss: bool = False,
        offload_states: bool = False,
    ) -> None:
        if config.fp16:
            raise NotImplementedError(
                "Engram tables with fp16 loss scaling are not supported: train in bf16 or fp32."
            )
        if config.optimizer != "adam":
            raise ValueError(
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
        self.num_steps = 0
        self.mixed_precision = any(p.dtype != torch.float32 for p in self.model_params)
        self.offload = bool(offload_states)
        if self.mixed_precision:
            self._hooks = [
                p.register_post_accumulate_grad_hook(self._accumulate_main_grad)
                for p in self.model_params
            ]
        else:
            self._hooks = []
        if self.offload:
            self._init_offload()
        elif self.mixed_precision:
            self.main_params = [
                torch.nn.Parameter(p.detach().float().clone()) for p in self.model_params
            ]
        else:
            self.main_params = self.model_params
        adam_cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
        group = dict(param_group, params=self.main_params)
        optimizer = adam_cls(
            [group],
            lr=param_group["lr"],
            weight_decay=param_group["weight_decay"],
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            # Host tensors: torch would pick its single-tensor loop; foreach is the same
            # algorithm as its CUDA default (and bitwise equal to the loop on CPU).
            **({"foreach": True} if self.offload else {}),
        )
        super().__init__(optimizer, config, init_state_fn=self._init_state)
        self.is_stub_optimizer = False
        device = self.model_params[0].device if self.model_params else runtime_device()
        self._scale = torch.ones(1, dtype=torch.float32, device=device)

    # -- offload -------------------------------------------------------------------------

    @torch.no_grad()
    def _init_offload(self) -> None:
        """Host masters, pinned host grad buffers, upload staging and device grad carriers."""
        # Async copies need pinned host memory and a CUDA device on the other side.
        self._async_copies = torch.cuda.is_available() and any(
            p.device.type == "cuda" for p in self.model_params
        )
        pin = self._async_copies

        def host(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(p.shape, dtype=dtype, device="cpu", pin_memory=pin)

        self.main_params = []
        self._host_grads = []
        self._upload_buffers = []
        self._grad_carriers = []
        for p in self.model_params:
            main = torch.nn.Parameter(host(p, torch.float32))
            main.data.copy_(p.detach())
            self.main_params.append(main)
            self._host_grads.append(host(p, torch.float32))
            self._upload_buffers.append(main.data if p.dtype == torch.float32
                                        else host(p, p.dtype))
            if not self.mixed_precision:
                carrier = p  # its .grad is the synced float32 gradient
            else:  # grads are in main_grad (the hook clears .grad, also of a float32 table):
                # a zero-stride float32 view of one device element holds it, no memory
                carrier = torch.zeros((), dtype=torch.float32, device=p.device).expand(p.shape)
            self._grad_carriers.append(carrier)
        self._copies_done: Any = None  # CUDA event after the last async copy

    def _wait_for_copies(self) -> None:
        """Host buffers may be read (after D2H) or written (after H2D) only once this returns."""
        if self._copies_done is not None:
            self._copies_done.synchronize()
            self._copies_done = None

    def _record_copies(self) -> None:
        if self._async_copies:
            self._copies_done = torch.cuda.Event()
            self._copies_done.record()

    @torch.no_grad()
    def _upload_masters(self) -> None:
        """Host masters -> device tables, cast to the table's dtype on the host."""
        self._wait_for_copies()
        for param, main, staged in zip(self.model_params, self.main_params,
                                       self._upload_buffers):
            if staged is not main.data:
                staged.copy_(main.data)
            param.data.copy_(staged, non_blocking=self._async_copies)
        self._record_copies()

    @torch.no_grad()
    def _refresh_masters_from_model(self) -> None:
        self._wait_for_copies()
        for param, main in zip(self.model_params, self.main_params):
            main.data.copy_(param.data)

    def get_parameters(self) -> list[torch.Tensor]:
        """Offload: device-side grad carriers (module docstring), which megatron's clipping
        scales in place; otherwise the tensors Adam steps."""
        if self.offload:
            return list(self._grad_carriers)
        return super().get_parameters()

    # -- gradients -----------------------------------------------------------------------

    @staticmethod
    @torch.no_grad()
    def _accumulate_main_grad(param: torch.nn.Parameter) -> None:
        """bf16 tables: accumulate micro-batch grads in float32, as megatron DDP's main_grad."""
        if getattr(param, "main_grad", None) is None:
            param.main_grad = torch.zeros_like(param, dtype=torch.float32)
        param.main_grad.add_(param.grad)
        param.grad = None

    def _local_grad(self, index: int) -> torch.Tensor:
        param = self.model_params[index]
        if self.mixed_precision:
            if getattr(param, "main_grad", None) is None:
                param.main_grad = torch.zeros_like(param, dtype=torch.float32)
            return param.main_grad
        if param.grad is None:  # unused this step: still join the collective
            param.grad = torch.zeros_like(param)
        return param.grad

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Sum table grads over the grad-sync group with megatron DDP's 1 / DP scaling."""
        scale = 1.0 / parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        for index, main in enumerate(self.main_params):
            grad = self._local_grad(index)
            grad.mul_(scale)
            if self.grad_sync_group is not None and self.grad_sync_group.size() > 1:
                dist.all_reduce(grad, group=self.grad_sync_group)
            if self.offload:
                if self._grad_carriers[index] is not self.model_params[index]:
                    self._grad_carriers[index].grad = grad
            elif self.mixed_precision:
                main.grad = grad
        return False

    def get_main_grads_for_grad_norm(self) -> list[torch.Tensor]:
        # Shards are disjoint within the norm group: no TP-duplicate filtering (megatron's
        # default would drop every TP rank but the first).
        holders = self._grad_carriers if self.offload else self.main_params
        return [p.grad for p in holders if p.grad is not None]

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
        zeros = torch.zeros(1, dtype=torch.float32, device=self._scale.device)
        for grad in self.get_main_grads_for_grad_norm():
            zeros += (grad == 0).sum()
        dist.all_reduce(zeros, group=self.grad_stats_parallel_group)
        return zeros.item()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.model_params:
            param.grad = None
            if getattr(param, "main_grad", None) is not None:
                param.main_grad.zero_()
        if self.offload:
            for carrier in self._grad_carriers:
                carrier.grad = None
        elif self.mixed_precision:
            for main in self.main_params:
                main.grad = None

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale

    # -- step ----------------------------------------------------------------------------

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        if self.offload:
            return self._offloaded_step()
        self.optimizer.step()
        if self.mixed_precision:
            for param, main in zip(self.model_params, self.main_params):
                param.data.copy_(main.data)
        self.num_steps += 1
        return True

    @torch.no_grad()
    def _offloaded_step(self) -> bool:
        """Device grads -> host, Adam on the host masters, masters -> device tables."""
        self._wait_for_copies()
        for index, (main, host_grad) in enumerate(zip(self.main_params, self._host_grads)):
            grad = self._grad_carriers[index].grad
            if grad is None:  # not prepared (no prepare_grads this step): a zero gradient
                grad = self._local_grad(index)
            host_grad.copy_(grad, non_blocking=self._async_copies)
            main.grad = host_grad
        self._record_copies()
        self._wait_for_copies()
        self.optimizer.step()
        self._upload_masters()
        self.num_steps += 1
        return True

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
        if self.offload:
            self._refresh_masters_from_model()
        elif self.mixed_precision:
            for param, main in zip(self.model_params, self.main_params):
                main.data.copy_(param.data.float())

    # -- state ---------------------------------------------------------------------------

    def _init_state(self, optimizer, config=None) -> None:
        """Adam state for every parameter (so a checkpoint can be loaded into it)."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if len(optimizer.state[p]) == 0:
                    optimizer.state[p]["step"] = torch.zeros((), dtype=torch.float32)
                    optimizer.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    optimizer.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)

    def offload_to_cpu(self) -> None:
        """megatron's RL hook; with offload the states already live in host memory."""
        if not self.offload:
            super().offload_to_cpu()

    def restore_from_cpu(self) -> None:
        """megatron's RL hook; with offload the states stay in host memory."""
        if not self.offload:
            super().restore_from_cpu()

    def state_dict(self) -> dict:
        # Same keys with and without offload: a float32 table's master is the table itself
        # (no offload) or an exact copy of it (offload), so only bf16 masters are saved.
        return {
            "optimizer": self.optimizer.state_dict(),
            "fp32_main_params": self.main_params if self.mixed_precision else None,
            "num_steps": self.num_steps,
        }

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False,
                           metadata: dict | None = None) -> dict:
        """Adam moments (and float32 main copies) as ShardedTensors shaped like their table's:
        global rows, same replica ids, so they reshard with it. The step count is common."""
        if is_loading:
            self._init_state(self.optimizer)
        state = self.state_dict()
        id_to_sharded = get_param_id_to_sharded_param_map(
            model_sharded_state_dict, self.model_params
        )
        missing = [i for i in range(len(self.model_params)) if i not in id_to_sharded]
        if missing:
            raise RuntimeError(
                f"Engram tables {missing} of this rank are not in the model's sharded state dict"
            )
        optim_state_to_sharding_state(state["optimizer"], id_to_sharded, exclude_keys=("step",))
        if self.mixed_precision:
            state["fp32_main_params"] = [
                make_sharded_optimizer_tensor(id_to_sharded[i], main, "optimizer.state.fp32_param")
                for i, main in enumerate(self.main_params)
            ]
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        optimizer_state = state_dict["optimizer"]
        num_steps = int(state_dict.get("num_steps", 0))
        for param_state in optimizer_state["state"].values():
            param_state["step"] = torch.tensor(float(num_steps), dtype=torch.float32)
        optimizer_state["param_groups"] = self._filter_and_reorder_param_groups(
            self.optimizer.param_groups, optimizer_state["param_groups"]
        )
        if self.offload:
            self._wait_for_copies()
        self.optimizer.load_state_dict(optimizer_state)
        saved_mains = state_dict.get("fp32_main_params") if self.mixed_precision else None
        if saved_mains is not None:
            with torch.no_grad():
                for main, saved in zip(self.main_params, saved_mains):
                    main.data.copy_(saved)
        elif self.offload:
            # float32 tables (or a checkpoint without masters): the model was loaded first.
            self._refresh_masters_from_model()
        self.num_steps = num_steps
