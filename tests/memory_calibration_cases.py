"""The trainer configurations the memory plan is calibrated on (tests/test_memory_plan.py).

Sized so that the bytes the plan models (weights, optimizer, Engram tables, activations,
logits) are at least about as large as the fixed baseline of a rank, and so that each run takes
a few seconds on one CPU core: a widened deepseek_v3_tiny, 2 steps, one micro-batch per step
(two under pipeline parallelism).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from launch import REPO, free_port, run_process

# deepseek_v3_tiny widened: hidden 256, 8 MLA heads, 8 routed experts, 4 layers.
WIDE = (
    "model.hidden_size=256", "model.ffn_hidden_size=1024", "model.num_attention_heads=8",
    "model.q_lora_rank=128", "model.kv_lora_rank=64", "model.qk_head_dim=32",
    "model.qk_pos_emb_head_dim=16", "model.v_head_dim=32", "model.num_moe_experts=8",
    "model.moe_ffn_hidden_size=256", "model.moe_shared_expert_intermediate_size=256",
    "model.engram_vocab_size=[200000,200000]", "model.n_embed_per_ngram=128",
)
RUN = ("train.train_iters=2", "train.eval_interval=null", "train.log_interval=1",
       "train.lr_warmup_iters=0", "train.seq_length=256", "train.micro_batch_size=4",
       "data.hash_prefetch=false")


@dataclass(frozen=True)
class Case:
    name: str
    nproc: int
    overrides: tuple[str, ...]

    def all_overrides(self) -> list[str]:
        return [*WIDE, *RUN, *self.overrides]


CASES = (
    Case("dense_fp32", 1, ("model.num_moe_experts=null", "model.moe_ffn_hidden_size=null",
                           "model.moe_shared_expert_intermediate_size=null", "model.use_engram=false",
                           "train.global_batch_size=4")),
    Case("moe_engram_device", 1, ("train.global_batch_size=4",)),
    Case("engram_host_bf16", 1, ("model.engram_table_placement=host", "system.precision=bf16",
                                 "model.engram_table_dtype=bf16", "train.global_batch_size=4")),
    Case("mhc_tp2", 2, ("model.enable_hyper_connections=true", "system.tensor_model_parallel_size=2",
                        "train.global_batch_size=4")),
    Case("pp2_engram", 2, ("system.pipeline_model_parallel_size=2", "train.global_batch_size=8")),
    Case("ep2_eps2_bf16", 2, ("system.expert_model_parallel_size=2", "system.precision=bf16",
                              "model.engram_embedding_parallel_size=2", "train.global_batch_size=8")),
    Case("recompute_long_seq", 1, ("system.recompute_granularity=full", "train.seq_length=2048",
                                   "train.micro_batch_size=2", "train.global_batch_size=2")),
)


def torchrun_calibration(nproc: int, out: Path, overrides: list[str], baseline: bool = False,
                         python: str = sys.executable, timeout: int = 600) -> list[dict]:
    """Peak RSS of every rank of one trainer run (or of the baseline process)."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
               TORCHDYNAMO_DISABLE="1")
    cmd = [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", str(REPO / "tests/dist/memory_calibration.py"),
           "--out", str(out), *(["--baseline"] if baseline else []),
           f"experiment.exp_dir={out / 'exp'}", *overrides]
    proc = run_process(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"calibration run failed ({overrides}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


if __name__ == "__main__":  # measure every case: python tests/memory_calibration_cases.py OUT.json
    import time

    results = {}
    root = Path(sys.argv[1]).with_suffix("")
    for nproc in (1, 2)[: 0 if len(sys.argv) > 2 else 2]:
        results[f"baseline{nproc}"] = torchrun_calibration(nproc, root / f"baseline{nproc}", list(RUN), True)
    for case in CASES:
        start = time.time()
        try:
            results[case.name] = torchrun_calibration(case.nproc, root / case.name, case.all_overrides())
        except AssertionError as e:
            results[case.name] = str(e)[-3000:]
        results[case.name + "_s"] = time.time() - start
        print(case.name, results[case.name], f"{results[case.name + '_s']:.0f}s", flush=True)
        Path(sys.argv[1]).write_text(json.dumps(results, indent=1))
