"""Peak memory of ``engram-import-hf`` on a DeepSeek-V4.1 folder in the released quantized
layout, per parameter of each rank's shard (docs/deepseek-v41.md 'Import and export').

The folder: the tiny V4.1 preset widened (``--hidden``, ``--experts``, ``--expert-width``,
``--engram-vocab``) to about 1e8 parameters, trained for one step at one process (the trainer
initialises it) and written by ``engram-export --format hf`` in the released layout. Then
``engram-import-hf`` of that folder, one process per configuration: float32 tables (the
default), fp8 tables on the host (``--engram-table-dtype fp8_e4m3 --engram-table-placement
host``), and at TP2 (2 processes). Each import reports every rank's peak RSS
(``ru_maxrss``), its RSS before the model was built and its shard's parameters
(``import_memory.json``); the result holds them with the bound the import is held to,
``12 B x shard parameters + 1 GiB``.

    python benchmarks/bench_v41_import_memory.py [--hidden 512] [--experts 16]
        [--expert-width 512] [--engram-vocab 40000] [--out benchmarks/results/...json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import free_port, write_result

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
TOKENIZER = REPO / "examples" / "data" / "tokenizer" / "tokenizer.json"
IMPORTS = {
    "fp32_tables": (1, []),
    "fp8_host_tables": (1, ["--engram-table-dtype", "fp8_e4m3", "--engram-table-placement", "host"]),
    "fp32_tables_tp2": (2, ["--tensor-model-parallel-size", "2"]),
}


def run(cmd: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])


def torchrun(nproc: int, module: str, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}", "-m", module, *map(str, args)]


def make_folder(root: Path, args) -> Path:
    """One trainer step of the widened preset, exported in the released layout."""
    vocab = args.engram_vocab
    run(torchrun(1, "engram_train.train", "model=deepseek_v41_tiny", f"data.tokenizer={TOKENIZER}",
                 f"model.hidden_size={args.hidden}", f"model.n_routed_experts={args.experts}",
                 f"model.moe_intermediate_size={args.expert_width}",
                 f"model.engram_vocab_size=[{vocab},{vocab},{vocab}]",
                 "train.global_batch_size=1", "train.micro_batch_size=1", "train.seq_length=32",
                 "train.train_iters=1", "train.eval_interval=null", "train.lr_warmup_iters=0",
                 f"checkpoint.save={root / 'ckpt'}", f"experiment.exp_dir={root}"))
    run([sys.executable, "-m", "engram_train.export", "--format", "hf",
         "--load", str(root / "ckpt"), "--out", str(root / "folder")])
    return root / "folder"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--expert-width", type=int, default=512)
    parser.add_argument("--engram-vocab", type=int, default=40000)
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_v41_import_memory.json")
    args = parser.parse_args()
    result = {"sizes": {k: v for k, v in vars(args).items() if k != "out"}, "imports": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        folder = make_folder(root, args)
        result["folder_bytes"] = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        result["folder_s"] = round(time.perf_counter() - started, 1)
        for name, (nproc, extra) in IMPORTS.items():
            out = root / name
            started = time.perf_counter()
            run(torchrun(nproc, "engram_train.hf.importer", "--hf", folder, "--out", out,
                         "--seq-length", 64, *extra))
            ranks = json.loads((out / "import_memory.json").read_text())
            for rank in ranks:
                params = rank["shard_parameters"]
                rank["peak_b_per_param"] = round(rank["peak_rss"] / params, 2)
                rank["over_baseline_b_per_param"] = round(
                    (rank["peak_rss"] - rank["rss_before_build"]) / params, 2)
                rank["bound_bytes"] = 12 * params + 2**30
                rank["within_bound"] = rank["peak_rss"] <= rank["bound_bytes"]
            result["imports"][name] = {"processes": nproc, "options": extra, "ranks": ranks,
                                       "seconds": round(time.perf_counter() - started, 1)}
            print(name, json.dumps(ranks))
    write_result(args.out, result)


if __name__ == "__main__":
    main()
