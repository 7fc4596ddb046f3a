"""benchmarks/gpu_check.py's TE-vs-local spec comparison run local-vs-local on the CPU, for
tests/test_gpu_check.py. Prints ``RESULT`` and the comparison's JSON."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_check  # noqa: E402

from engram_train.runtime import ParallelSizes, initialize_distributed  # noqa: E402


def main() -> None:
    initialize_distributed(ParallelSizes())
    ctx = gpu_check.Context(device=torch.device("cpu"), world=1, rank=0, quick=True)
    print("RESULT" + json.dumps(gpu_check.compare_specs(ctx, second_te=False)))


if __name__ == "__main__":
    main()
