"""engram-sweep: spend the same parameters on routed experts or on Engram, train, compare.

From a base MoE preset and a total-parameter budget, derives:

  moe                    pure MoE: every sparse parameter in routed experts (the budget sets
                         the expert count; without --total-params, the base's own experts)
  engram_rho<r>          for each rho in --rhos (default 0.2, 0.4, 0.6): round(rho x experts)
                         routed experts removed (top-k kept, so activated expert parameters stay
                         the same), Engram tables sized so the total matches the MoE's within 1%
  engram_rho<r>_one_row  control on the first rho: one row per head (memory removed,
                         projections, gate and conv kept; model.engram_one_row_per_head)
  engram_rho<r>_frozen   control on the first rho: tables frozen at their init
                         (model.engram_freeze_tables)

Parameter counts are the project's (engram_train.training.param_count, the model built on the
meta device); activated parameters are reported for every variant. Each variant is trained for
every seed through `torchrun -m engram_train.train`, seed-major (all variants for one seed, then
the next), on the same tokens in the same order, with the same schedule; a token is never
trained on twice (checked against the train split) and the validation split is held out.

Outputs (in --out): allocation_sweep.json (`runs`: one entry per variant and seed with variant,
rho, seed, total_params, active_params, tokens, val_loss, tokens_per_s, step_time_s and the loss
curves; `summary`: median and range over seeds, throughput relative to the MoE run of the same
seed), allocation_loss_vs_rho.png, allocation_throughput.png, allocation_loss_curves.png;
runs/<variant>_seed<s>/ holds each run's trainer outputs; a stopped sweep resumes.

Positional overrides: `model.<key>=<value>` change the base preset before the variants are
derived; any other Hydra override (`train.lr=1e-3`) goes to every run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engram_train.config import resolve
from engram_train.errors import EngramError
from engram_train.sweep.variants import CONTROLS, DEFAULT_RHOS, SweepError

DEMO = {"data_path": "examples/data/demo_text_document", "split": "90,10,0",
        "tokenizer": "examples/data/tokenizer"}


def _number(text: str) -> int:
    """12000000, 12e6 or 12M (K, M, B suffixes)."""
    scale = {"k": 1e3, "m": 1e6, "b": 1e9}.get(text[-1:].lower(), 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def _list(kind):
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engram-sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("variants")
    g.add_argument("--preset", default="deepseek_v3_tiny",
                   help="base MoE: a conf/model name or a path to your own model YAML; its "
                   "Engram fields (layers, N, heads, width) shape the Engram variants")
    g.add_argument("--total-params", type=_number, default=None, metavar="N",
                   help="total-parameter budget (e.g. 12M): the pure MoE's expert count is "
                   "chosen to come nearest; default: the base's own experts")
    g.add_argument("--rhos", type=_list(float), default=list(DEFAULT_RHOS),
                   help="shares of the routed-expert parameters given to Engram (default "
                   "0.2,0.4,0.6)")
    g.add_argument("--controls", type=_list(str), default=list(CONTROLS),
                   help="controls on the first rho: one_row,frozen (default both; '' none)")
    g.add_argument("--variants", type=_list(str), default=None,
                   help="train only these variant names (default: all derived)")
    g.add_argument("--dry-run", action="store_true",
                   help="print the derived variants as JSON lines (variant, rho, total_params, "
                   "active_params, ...) and exit without training")
    d = p.add_argument_group("data (the same tokens for every run)")
    d.add_argument("--corpus", type=Path, default=None,
                   help="a folder written by scripts/build_code_corpus.py (its corpus.json "
                   "gives the prefix, the train/validation split by file, the tokenizer)")
    d.add_argument("--data-path", default=None, help=f"indexed dataset prefix (default: the "
                   f"demo corpus, {DEMO['data_path']})")
    d.add_argument("--split", default=None, help="train,valid,test document shares")
    d.add_argument("--tokenizer", default=None, help="tokenizer folder")
    t = p.add_argument_group("schedule (the same for every run)")
    t.add_argument("--train-iters", type=int, default=200)
    t.add_argument("--global-batch-size", type=int, default=8)
    t.add_argument("--micro-batch-size", type=int, default=None, help="default: global")
    t.add_argument("--seq-length", type=int, default=128)
    t.add_argument("--eval-interval", type=int, default=None,
                   help="iterations between validations (default: train-iters / 4)")
    t.add_argument("--eval-iters", type=int, default=8,
                   help="validation batches (global-batch-size sequences each)")
    t.add_argument("--seeds", type=_list(int), default=[1, 2])
    r = p.add_argument_group("running")
    r.add_argument("--nproc", type=int, default=1, help="processes per run (torchrun)")
    r.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every run")
    r.add_argument("--out", type=Path, default=Path("outputs/allocation_sweep"),
                   help="run folders, configs, the JSON and the figures")
    p.add_argument("overrides", nargs="*",
                   help="model.<key>=<value> (base preset) or Hydra overrides for every run")
    return p


def _data(args) -> dict:
    data = dict(DEMO)
    if args.corpus is not None:
        meta_path = args.corpus / "corpus.json"
        if not meta_path.is_file():
            raise SweepError(f"--corpus {args.corpus}: no corpus.json; build it with "
                             "scripts/build_code_corpus.py --out " + str(args.corpus))
        meta = json.loads(meta_path.read_text())
        data = {"data_path": str(args.corpus / meta["prefix"]), "split": meta["split"],
                "tokenizer": str(args.corpus / meta["tokenizer"])}
    for key in ("data_path", "split", "tokenizer"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    return data


def _table_use(variant, tokens: int) -> dict:
    """Rows per table and how often an average row is looked up over the run's tokens."""
    m = variant.model
    if not resolve(m)["use_engram"]:
        return {}
    width = m["n_embed_per_ngram"] // m["n_head_per_ngram"]
    rows = variant.counts["engram_tables"] // width
    lookups = tokens * len(m["engram_layer_ids"]) * (m["max_ngram_size"] - 1) * m["n_head_per_ngram"]
    return {"table_rows": rows, "lookups_per_row": round(lookups / rows, 1)}


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        _main(args)
    except EngramError as e:
        raise SystemExit(f"engram-sweep: {e}") from None


def _main(args) -> None:
    if not args.seeds:
        raise SweepError("--seeds names no seed, so nothing would be trained: give one or more, e.g. --seeds 1,2")
    from engram_train.sweep import report, runner, variants

    model_overrides = [o for o in args.overrides if o.startswith("model.")]
    extra = [o for o in args.overrides if not o.startswith("model.")]
    data = _data(args)
    base = variants.apply_overrides(variants.load_preset(args.preset), model_overrides)
    from engram_train.data import load_tokenizer

    vocab = load_tokenizer(data["tokenizer"]).vocab_size
    with variants.meta_counter([f"data.tokenizer={data['tokenizer']}"], vocab) as count:
        derived = variants.derive_variants(base, count, args.total_params, args.rhos,
                                           args.controls)
    if args.variants is not None:
        unknown = sorted(set(args.variants) - {v.name for v in derived})
        if unknown:
            raise SweepError(f"--variants {unknown} are not derived here: "
                             f"{[v.name for v in derived]}")
        derived = [v for v in derived if v.name in args.variants]
    iters = args.train_iters
    schedule = runner.Schedule(
        data_path=data["data_path"], split=data["split"], tokenizer=data["tokenizer"],
        train_iters=iters, global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size or args.global_batch_size,
        seq_length=args.seq_length, eval_interval=args.eval_interval or max(1, iters // 4),
        eval_iters=args.eval_iters, nproc=args.nproc, threads=args.threads)
    rows = [{**v.summary(), **_table_use(v, schedule.tokens)} for v in derived]
    if args.dry_run:
        for row in rows:
            print(json.dumps(row))
        return
    if iters % schedule.eval_interval:
        raise SweepError(f"--eval-interval {schedule.eval_interval} must divide --train-iters "
                         f"{iters}: the final validation loss is read at the last iteration")
    split_tokens = runner.check_single_epoch(schedule)
    meta = {"preset": args.preset, "model_overrides": model_overrides, "trainer_overrides": extra,
            "total_params_budget": args.total_params, "rhos": args.rhos,
            "seeds": args.seeds, "vocab_size": vocab, "data": data, "split_tokens": split_tokens,
            "schedule": {**vars(schedule), "tokens": schedule.tokens},
            "order": "seed-major: every variant for one seed, then the next seed",
            "variants": rows}
    out = args.out
    json_path = out / "allocation_sweep.json"

    def on_run(runs):
        report.write_json(json_path, meta, runs)

    runs = runner.run_sweep(derived, args.seeds, schedule, out, extra, on_run)
    final = report.write_json(json_path, meta, runs)
    print(report.markdown_table(final))
    for path in [json_path, *report.write_figures(final, out)]:
        print(f"engram-sweep: wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
