"""The mHC backbone (n = 4 residual streams) inside megatron, 4 processes, one launch:

- invariance: without Engram, with ``mhc_init_gating_factor = 0`` and the init biases, the
  4-stream model's loss and gradients equal the single-stream model's (same backbone weights);
- layouts: mHC + Engram from one checkpoint, 6 optimizer steps on the same global batches under
  DP4 (the reference), TP2 x PP2 (SP) x eps 2, PP2 x VPP2, PP2 with full recompute, DP4 with
  selective recompute (core_attn, mlp, moe), EP2 x eps 4
  with host tables and the distributed optimizer, allreduce TP2 (SP), bf16 on DP4;
- reshard: the TP2 x PP2 run saves after 3 steps; DP4 (TP1 x PP1) loads it and continues with
  the same losses as the TP2 x PP2 run;
- the Engram layer inside the mHC model against DeepSeek's reference module on the golden
  4-stream case (hidden states, output, input gradient);
- a checkpoint with mHC does not load into a model without it (missing/unexpected keys).
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))

import torch
import torch.distributed as dist
from common import forget_graphs
from common import SEQ, VOCAB, parse_args, repeated_batches, tiny_config, write_result
from engram_integration import ENGRAM, build, dp_share_of_step

from engram_train.runtime import ParallelSizes, initialize_distributed

from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig

from engram_train.checkpoint import load_checkpoint, save_checkpoint
from engram_train.config import EngramMLATransformerConfig
from engram_train.models.builder import build_model
from engram_train.training.optimizer import build_optimizer
from engram_train.training.step import run_forward_backward, train_step

LAYER_IDS = [1, 3]
GLOBAL_BATCH = 8
MICRO_BATCH = 2
STEPS = 6
SAVE_AFTER = 3
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
LAYOUTS = [  # name, ParallelSizes, sequence parallel, config overrides, distributed optimizer
    ("dp4", ParallelSizes(), False, {}, False),
    ("tp2pp2sp_eps2", ParallelSizes(tensor=2, pipeline=2, engram_embedding=2), True, {}, False),
    ("pp2vpp2", ParallelSizes(pipeline=2, virtual_pipeline=2), False,
     dict(virtual_pipeline_model_parallel_size=2), False),
    ("pp2_full_recompute", ParallelSizes(pipeline=2), False, FULL_RECOMPUTE, False),
    ("dp4_selective_recompute", ParallelSizes(), False,
     dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "moe"]),
     False),
    ("ep2_eps4_host_distopt", ParallelSizes(expert=2, engram_embedding=4), False,
     dict(engram_table_placement="host"), True),
    ("allreduce_tp2sp", ParallelSizes(tensor=2), True,
     dict(engram_embedding_parallel_method="allreduce"), False),
    ("dp4_no_mhc_recompute", ParallelSizes(), False, dict(recompute_modules=[]), False),
]
TP_LAYOUTS = ("tp2pp2sp_eps2", "allreduce_tp2sp")
LR = 3e-4
"""Where the tiny model's dynamics are stable: at 3e-3 without warm-up it is chaotic (every
step clipped) and TP's summation order alone drifts the losses by ~1e-3 in a few steps."""
RESHARD_FROM = "tp2pp2sp_eps2"


def init(layout: ParallelSizes, seed=1):
    parallel_state.destroy_model_parallel()
    forget_graphs()  # the previous layout's model can be freed
    initialize_distributed(layout, seed=seed)


def mhc_config(layout: ParallelSizes, sp=False, engram=True, **overrides):
    fields = dict(ENGRAM, engram_layer_ids=LAYER_IDS) if engram else {}
    if layout.engram_embedding > 1:
        fields["engram_embedding_parallel_size"] = layout.engram_embedding
    fields.update(enable_hyper_connections=True, num_residual_streams=4)
    fields.update(overrides)
    cfg = tiny_config(tp=layout.tensor, pp=layout.pipeline, ep=layout.expert, sp=sp,
                      config_class=EngramMLATransformerConfig, **fields)
    cfg.finalize_model_grads_func = finalize_model_grads
    return cfg


def shared_tmpdir() -> Path:
    holder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])


def step_batches(step: int):
    """This data-parallel rank's share of the global batch of ``step`` (a new one each step)."""
    return dp_share_of_step(300 + step, LAYER_IDS, GLOBAL_BATCH, MICRO_BATCH)


def check_invariance(result):
    """Single- vs 4-stream, gating factor 0, no Engram: first-step loss and every backbone
    gradient (the 4-stream model loads the single-stream model's weights)."""
    init(ParallelSizes(), seed=5)
    batches = repeated_batches(2, MICRO_BATCH, seed=9)
    runs = {}
    for streams in (1, 4):
        cfg = tiny_config(config_class=EngramMLATransformerConfig,
                          enable_hyper_connections=streams > 1, num_residual_streams=4,
                          mhc_init_gating_factor=0.0)
        cfg.finalize_model_grads_func = finalize_model_grads
        model = build_model(cfg, VOCAB, SEQ)
        if streams == 1:
            weights = {k: v.clone() for k, v in model[0].module.state_dict().items()
                       if isinstance(v, torch.Tensor)}
        else:
            keys = model[0].module.load_state_dict(weights, strict=False)
            result["invariance_unexpected"] = list(keys.unexpected_keys)
            result["invariance_missing"] = sorted(keys.missing_keys)
        model[0].zero_grad_buffer()
        losses = run_forward_backward(model, batches, SEQ, MICRO_BATCH)
        total = torch.stack([d["lm loss"] for d in losses]).sum(0)
        grads = {n: p.main_grad.clone() for n, p in model[0].named_parameters()}
        runs[streams] = ((total[0] / total[1]).item(), grads)
    result["invariance_loss"] = [runs[1][0], runs[4][0]]
    worst = {}
    for name, grad in runs[1][1].items():
        other = runs[4][1][name]
        worst[name] = ((grad - other).norm() / grad.norm().clamp_min(1e-30)).item()
    result["invariance_grad_rel"] = worst
    result["invariance_mapping_grads_nonzero"] = all(
        g.abs().sum().item() > 0 for n, g in runs[4][1].items() if n.endswith(("base", "hc_base")))


def setup(name, layout, sp, overrides, distopt, seed):
    init(layout, seed=seed)
    cfg = mhc_config(layout, sp, **overrides)
    model = build(cfg, distopt)
    if len(model) > 1:
        cfg.no_sync_func = [m.no_sync for m in model]
    opt_config = OptimizerConfig(optimizer="adam", lr=LR, clip_grad=0.5, weight_decay=0.0,
                                 use_distributed_optimizer=distopt,
                                 bf16=bool(overrides.get("bf16")),
                                 params_dtype=overrides.get("params_dtype", torch.float32))
    return model, build_optimizer(opt_config, model, cfg)


def check_layouts(result, root: Path):
    init(ParallelSizes(), seed=11)
    base = mhc_config(ParallelSizes())
    save_checkpoint(root / "base", 0, build(base))
    for name, layout, sp, overrides, distopt in LAYOUTS:
        model, optimizer = setup(name, layout, sp, overrides, distopt, seed=21)
        load_checkpoint(root / "base", model)
        steps = []
        for step in range(STEPS):
            steps.append(train_step(model, optimizer, step_batches(step), SEQ, MICRO_BATCH))
            if name == RESHARD_FROM and step + 1 == SAVE_AFTER:
                save_checkpoint(root / "reshard", SAVE_AFTER, model, optimizer)
            if name in TP_LAYOUTS and step + 1 == SAVE_AFTER:
                result[f"{name}_replicated"] = tp_replicated_differences(model)
        result[name] = dict(losses=[s.lm_loss for s in steps],
                            grad_norms=[s.grad_norm for s in steps])
    # TP2 x PP2 x eps 2 -> TP1 x PP1: load model and optimizer, continue the same batches.
    model, optimizer = setup("reshard", ParallelSizes(), False, {}, False, seed=31)
    iteration, _ = load_checkpoint(root / "reshard", model, optimizer)
    result["reshard_iteration"] = iteration
    result["reshard_losses"] = [train_step(model, optimizer, step_batches(step), SEQ,
                                           MICRO_BATCH).lm_loss
                                for step in range(SAVE_AFTER, STEPS)]
    # bf16 on DP4 with the distributed optimizer: the mappings float32, the losses near fp32's.
    model, optimizer = setup("bf16", ParallelSizes(), False, BF16, True, seed=41)
    load_checkpoint(root / "base", model)
    result["bf16_losses"] = [train_step(model, optimizer, step_batches(step), SEQ,
                                        MICRO_BATCH).lm_loss for step in range(STEPS)]
    check_float32_mappings(result, model, optimizer, root)


BF16 = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)


def is_mapping(name: str) -> bool:
    return any(part in name for part in ("attn_hc.", "ffn_hc.", "hc_head."))


def tp_replicated_differences(model) -> dict:
    """Every parameter replicated across TP (not split by megatron's tensor parallelism, not an
    Engram table shard) compared bitwise with TP rank 0's: ``{"checked": names,
    "different": names}``."""
    group = parallel_state.get_tensor_model_parallel_group()
    checked, different = [], []
    for chunk in model:
        for name, param in chunk.named_parameters():
            if (getattr(param, "tensor_model_parallel", False)
                    or getattr(param, "is_engram_table", False)
                    or not getattr(param, "allreduce", True)):  # experts: split over EP / ETP
                continue
            copies = [torch.empty_like(param.data) for _ in range(group.size())]
            dist.all_gather(copies, param.data.contiguous(), group=group)
            checked.append(name)
            if not all(torch.equal(copies[0], c) for c in copies[1:]):
                different.append(name)
    return {"checked": checked, "different": different}


def megatron_params_by_kind(optimizer) -> tuple[set[int], set[int]]:
    """ids of the model parameters megatron's optimizers step on this rank: as float32
    parameters (their own main parameters: ``fp32_from_fp32_groups`` / the distributed
    optimizer's ``model_fp32_groups``), and as float16/bf16 ones with a float32 master."""
    fp32, float16 = set(), set()
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for kind, attrs in ((fp32, ("fp32_from_fp32_groups", "model_fp32_groups")),
                            (float16, ("float16_groups", "model_float16_groups"))):
            for attr in attrs:
                for group in getattr(part, attr, []):
                    kind.update(id(p) for p in group)
    return fp32, float16


def mappings_fp32_in_optimizer(params: dict, optimizer) -> bool:
    """Every mapping parameter is stepped as a float32 parameter: none with a bf16 master on
    this rank, and each one held as float32 by some data-parallel rank (the distributed
    optimizer gives each rank its shard of the parameters)."""
    fp32, float16 = megatron_params_by_kind(optimizer)
    names = sorted(n for n in params if is_mapping(n))
    if any(id(params[n]) in float16 for n in names):
        return False
    held = torch.tensor([float(id(params[n]) in fp32) for n in names])
    dist.all_reduce(held, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
    return bool(names) and bool(held.all())


def main_params_are_own_shards(optimizer) -> bool:
    """Whether the distributed optimizer's checkpoint view (``_get_main_param_and_optimizer_states``,
    which its save and load use) gives every model parameter its own main shard: after a step
    the bf16 parameter is its float32 main shard rounded, a float32 one is the shard itself."""
    checked = 0
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for buffers in getattr(part, "gbuf_ranges", []):
            for ranges in buffers.values():
                for bucket in ranges:
                    for param, where in bucket["param_map"].items():
                        main = part._get_main_param_and_optimizer_states(param)["param"]
                        own = param.detach().view(-1)[where["param"].start:where["param"].end]
                        if main.shape != own.shape or not torch.equal(main.to(param.dtype), own):
                            return False
                        checked += 1
    return checked > 0


def stored_dtypes(directory: Path) -> dict:
    """dtype of every tensor in a megatron distributed checkpoint (its torch DCP metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = next(directory.rglob(".metadata")).parent
    entries = FileSystemReader(str(metadata)).read_metadata().state_dict_metadata
    return {k: str(v.properties.dtype) for k, v in entries.items() if hasattr(v, "properties")}


def check_float32_mappings(result, model, optimizer, root: Path):
    """bf16: the mappings stay float32 (parameters, gradients, megatron's float32 parameters
    in the distributed optimizer, the checkpoint); a checkpoint with bf16 mappings (as written
    before they were float32) still loads."""
    params = dict(model[0].named_parameters())
    fp32, _ = megatron_params_by_kind(optimizer)
    result["bf16_mapping_dtypes"] = sorted({str(p.dtype) for n, p in params.items()
                                            if is_mapping(n)})
    result["bf16_other_dtypes"] = sorted({str(p.dtype) for n, p in params.items()
                                          if not is_mapping(n) and "engram" not in n})
    result["bf16_mapping_grad_dtypes"] = sorted({str(p.main_grad.dtype)
                                                 for n, p in params.items() if is_mapping(n)})
    result["bf16_mappings_fp32_in_optimizer"] = mappings_fp32_in_optimizer(params, optimizer)
    result["bf16_others_fp32_in_optimizer"] = any(
        id(p) in fp32 for n, p in params.items() if not is_mapping(n))
    result["bf16_optimizer_state_maps_to_own_shard"] = main_params_are_own_shards(optimizer)
    save_checkpoint(root / "bf16", STEPS, model, optimizer)
    dtypes = stored_dtypes(root / "bf16")
    result["bf16_stored_mapping_dtypes"] = sorted({d for k, d in dtypes.items()
                                                   if is_mapping(k) and "optimizer" not in k})
    result["bf16_stored_mapping_count"] = sum(is_mapping(k) for k in dtypes)
    # A checkpoint of bf16 mappings (the layout before they were float32) loads, upcast.
    init(ParallelSizes(), seed=43)
    old = build_model(mhc_config(ParallelSizes(), **BF16), VOCAB, SEQ, wrap_with_ddp=False)
    for name, param in old[0].named_parameters():
        if is_mapping(name):
            param.data = (param.data + 0.01 * torch.randn_like(param.data)).bfloat16()
    save_checkpoint(root / "bf16_mappings", 0, old)
    want = {n: p.detach().float().clone() for n, p in old[0].named_parameters() if is_mapping(n)}
    new = build(mhc_config(ParallelSizes(), **BF16))
    load_checkpoint(root / "bf16_mappings", new)
    got = {n: p for n, p in new[0].module.named_parameters() if is_mapping(n)}
    result["old_bf16_mappings_load"] = (
        len(got) == len(want) > 0
        and all(p.dtype == torch.float32 and torch.equal(p.detach(), want[n])
                for n, p in got.items()))


def check_refusal(result, root: Path):
    """A checkpoint with mHC does not load into a single-stream model, nor the reverse."""
    init(ParallelSizes(), seed=51)
    plain = mhc_config(ParallelSizes(), enable_hyper_connections=False)
    for what, cfg, ckpt in (("mhc_into_plain", plain, root / "base"),):
        model = build(cfg)
        try:
            load_checkpoint(ckpt, model)
            result[what] = "loaded"
        except Exception as e:  # noqa: BLE001 - the message is what the test reads
            result[what] = f"{type(e).__name__}: {e}"[:2000]
    save_checkpoint(root / "plain", 0, build(plain))
    with_mhc = mhc_config(ParallelSizes())
    model = build(with_mhc)
    try:
        load_checkpoint(root / "plain", model)
        result["plain_into_mhc"] = "loaded"
    except Exception as e:  # noqa: BLE001
        result["plain_into_mhc"] = f"{type(e).__name__}: {e}"[:2000]


def check_golden_engram_layer(result):
    """The Engram layer of the mHC model (layer 3, hc_mult = 4, hidden 48) loaded with the
    golden case's weights: its branch on the golden [S, B, 4*48] streams equals the reference
    module's output and input gradient."""
    from golden_cases import GOLDEN_DIR, engram_config, load_meta, tokenizer_path
    from safetensors.torch import load_file as load_torch

    from engram_train.engram.ngram_hash import NgramHashMapping
    from engram_train.engram.reference_io import REFERENCE_TABLE, load_reference_state_dict

    from engram_train.models.engram_layer import EngramHyperConnectionLayer

    meta = load_meta("case_a")
    golden = load_torch(str(GOLDEN_DIR / "case_a_engram_layer3_hc4.safetensors"))
    init(ParallelSizes(), seed=61)
    cfg = tiny_config(
        config_class=EngramMLATransformerConfig, hidden_size=48, use_engram=True,
        engram_tokenizer_name_or_path=str(tokenizer_path(meta)),
        engram_vocab_size=meta["engram_vocab_size"], max_ngram_size=meta["max_ngram_size"],
        n_embed_per_ngram=meta["n_embed_per_ngram"], n_head_per_ngram=meta["n_head_per_ngram"],
        engram_layer_ids=meta["layer_ids"], engram_pad_id=meta["pad_id"],
        engram_seed=meta["seed"], engram_kernel_size=meta["kernel_size"],
        enable_hyper_connections=True, num_residual_streams=4,
    )
    model = build_model(cfg, VOCAB, SEQ, wrap_with_ddp=False)[0]
    layer = next(m for m in model.modules()
                 if isinstance(m, EngramHyperConnectionLayer) and m.engram_layer_id == 3)
    num_rows, dim = golden["table_num_rows"].tolist()
    table = torch.zeros(num_rows, dim)
    table[golden["table_rows"]] = golden[f"param.{REFERENCE_TABLE}.rows"]
    state = {name[len("param."):]: value for name, value in golden.items()
             if name.startswith("param.") and not name.endswith(".rows")}
    state[REFERENCE_TABLE] = table
    load_reference_state_dict(layer.engram, state)

    mapping = NgramHashMapping(engram_config(meta, hc_mult=4))
    hash_ids = torch.as_tensor(mapping.hash(golden["input_ids"].numpy())[3]).transpose(0, 1)
    streams = golden["hidden_states"].transpose(0, 1).contiguous()  # [S, B, 4, 48]
    s, b, n, h = streams.shape
    hidden = streams.reshape(s, b, n * h).requires_grad_(True)
    output = layer.engram_branch(hidden, hash_ids.contiguous())
    expected = golden["output"].transpose(0, 1).reshape(s, b, n * h)
    result["golden_output_max_diff"] = (output - expected).abs().max().item()
    result["golden_output_scale"] = expected.abs().max().item()
    (output * golden["probe"].transpose(0, 1).reshape(s, b, n * h)).sum().backward()
    want = golden["grad_hidden_states"].transpose(0, 1).reshape(s, b, n * h)
    result["golden_grad_rel"] = ((hidden.grad - want).norm() / want.norm()).item()


def main():
    args = parse_args()
    result = {}
    check_invariance(result)
    init(ParallelSizes(), seed=3)
    root = shared_tmpdir()
    check_layouts(result, root)
    check_refusal(result, root)
    check_golden_engram_layer(result)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
