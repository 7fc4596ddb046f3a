"""Every preset's parameter counts built on the meta device, in one process (single-rank
parallel state), for tests/test_presets.py.

    python tests/dist/preset_counts.py '{"PRESET": VOCAB_OR_NULL, ...}'

Prints ``COUNTS`` and a JSON object: preset -> the counts of ``run_config_counts``.
"""

import json
import os
import sys

from engram_train.runtime import ParallelSizes, destroy_distributed, initialize_distributed
from engram_train.training.param_count import compose_config, run_config_counts


def main() -> None:
    os.environ["WORLD_SIZE"], os.environ["RANK"] = "1", "0"
    initialize_distributed(ParallelSizes())
    out = {}
    for name, vocab in json.loads(sys.argv[1]).items():
        out[name] = run_config_counts(compose_config([f"model={name}"]), None, vocab)
    destroy_distributed()
    print("COUNTS" + json.dumps(out))


if __name__ == "__main__":
    main()
