"""torchrun for the test scripts, with the imports paid once per launch instead of once per rank.

``python tests/forked_torchrun.py --nproc-per-node N --master-port P tests/dist/<script>.py ARGS``
runs what ``torchrun --nproc-per-node N --master-port P <script> ARGS`` runs: torch's elastic
launcher (the machinery behind the ``torchrun`` command: one local agent, static rendezvous on
the given port, ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set per worker, the
agent's store shared with the workers). The difference is how a worker starts: torchrun's
command-line form executes a fresh interpreter per rank, which imports torch and megatron-core
again (about 5 s of CPU each); this launcher imports them once and lets the elastic agent
*fork* its workers (``start_method="fork"``, a start method the launcher API offers for
function entry points), each of which then runs the script as ``__main__``. The import happens
before any thread of torch's pools or of a process group exists, so the fork is safe.
"""

from __future__ import annotations

import argparse
import atexit
import runpy
import signal
import sys
import traceback
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# What every tests/dist script imports (module level); anything else loads in the worker.
PRELOAD = (
    "torch", "torch.distributed", "numpy",
    "megatron.core", "megatron.core.parallel_state", "megatron.core.models.gpt",
    "megatron.core.optimizer", "megatron.core.distributed", "megatron.core.dist_checkpointing",
    "megatron.core.pipeline_parallel", "megatron.core.transformer",
    "engram_train.runtime", "engram_train.models.builder", "engram_train.checkpoint",
    "engram_train.training.step",
)


def run_as_main(target: str, argv: list[str], module: bool = False) -> None:
    """The worker: the script as ``python -u script argv`` would run it (``module``: the module
    as ``python -u -m target argv``)."""
    # A fresh interpreter's signal dispositions: the agent's SIGTERM handler (which raises in
    # the agent) is inherited through the fork; a rank that the agent stops must just end.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [target, *argv]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[:0] = [str(Path(target).resolve().parent)]
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    except BaseException:
        # every failing rank's own traceback, as a per-rank interpreter would print it (the
        # launcher's summary names only the first failure it sees, often a peer's broken pipe)
        traceback.print_exc()
        sys.stderr.flush()
        raise
    finally:
        atexit._run_exitfuncs()  # the rank's exit handlers, as its own interpreter would run them


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()

    import importlib

    sys.path[:0] = [str(REPO)]
    for name in PRELOAD:
        importlib.import_module(name)
    launch(args.nproc_per_node, args.master_port, args.script, args.args)


def launch(nproc: int, port: int, target: str, argv: list[str], module: bool = False) -> None:
    """torch's elastic launcher with forked ranks, each running ``target`` as ``__main__``."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        run_id=str(uuid.uuid4()), rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"rank": 0},
        max_restarts=0, monitor_interval=0.1, start_method="fork")
    elastic_launch(config, run_as_main)(target, argv, module)


if __name__ == "__main__":
    main()
