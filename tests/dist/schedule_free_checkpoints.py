"""Checkpoints that carry no LR schedule, as an import writes them: the trainer's own model
(built by its `check` and `build` stages, without Engram) saved at iteration 0 with no
scheduler state, once with a fresh optimizer (built for the default ``train.lr``) and once with
the model's weights only. The resume tests check that the continuing run's schedule applies."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
from common import parse_args, write_result
from hydra import compose, initialize_config_dir
from engram_train.config import register

import engram_train.config  # noqa: F401  (registers the run schema conf/train.yaml builds on)

REPO = Path(__file__).resolve().parents[2]


def fresh_adam_state(optimizer) -> None:
    """Adam before its first step (zero moments, step 0): megatron's state_dict needs a step."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    register()  # the run config's schema (conf/train.yaml's defaults)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(config_name="train", overrides=[f"experiment.exp_dir={out / 'build'}", "model.use_engram=false"])
    from engram_train.checkpoint import save_checkpoint
    from engram_train.training.job import build
    from engram_train.training.plan import check

    plan = check(cfg)
    job = build(cfg, plan)
    fresh_adam_state(job.optimizer)
    extra = {"consumed_samples": 0}
    save_checkpoint(out / "with_optimizer", 0, job.model, job.optimizer, extra=extra, run_identity=plan.identity)
    save_checkpoint(out / "model_only", 0, job.model, None, extra=extra, run_identity=plan.identity)
    write_result(args.out, {"max_lr": [g["max_lr"] for g in job.optimizer.param_groups]})


if __name__ == "__main__":
    main()
