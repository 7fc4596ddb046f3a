"""Checkpoints, exports and imports written by an earlier version of the project, and the
commands that check the current one against them (tests/test_stored_family_runs.py).

``python tests/family_fixtures.py save DIR`` (once, on the version whose artefacts are kept)
writes into DIR, through the shared commands (``engram-train``, ``engram-export --format hf``,
``engram-import-hf``):

- ``tokenizer/``: a word-level tokenizer of 100 entries (the embedding pads it to 128 rows);
- ``data/``: a few documents of the demo corpus, preprocessed with it;
- ``v3/``, ``v41/``: two steps of a shrunk ``deepseek_v3_tiny`` (Engram on) and of a shrunk
  ``deepseek_v41_tiny`` (Engram on), saved at iteration 2 (model and optimizer);
- ``v3_plain_hf/``, ``v3_import/``: the V3 model without Engram exported to transformers
  (``--format hf``: a stock ``deepseek_v3`` folder) and imported back (model only);
- ``expected.json``: the losses of the steps after each checkpoint, the sha256 of every file of
  each export and of each imported tensor.

The test resumes each stored checkpoint, exports and imports again, and asserts the same
numbers and bytes: a change that moves code must leave them as they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "examples" / "data" / "demo_corpus.jsonl"
WORDS = 99  # + <|endoftext|>: 100 ids, padded to 128 rows
DOCUMENTS = 12
SAVED_AT = 2
RESUMED_ITERS = 2

V3_MODEL = [
    "model=deepseek_v3_tiny", "model.num_layers=2", "model.hidden_size=32",
    "model.num_attention_heads=2", "model.ffn_hidden_size=32", "model.q_lora_rank=16",
    "model.kv_lora_rank=16", "model.qk_head_dim=8", "model.qk_pos_emb_head_dim=4",
    "model.v_head_dim=8", "model.moe_ffn_hidden_size=8",
    "model.moe_shared_expert_intermediate_size=8", "model.engram_vocab_size=[101,103]",
    "model.n_embed_per_ngram=16", "model.engram_layer_ids=[1]",
]
V41_MODEL = [
    "model=deepseek_v41_tiny", "model.hidden_size=32", "model.head_dim=32",
    "model.num_attention_heads=2", "model.num_hidden_layers=3", "model.compress_ratios=[0,2,2]",
    "model.kv_source_layer_ids=[1]", "model.index_source_layer_ids=[1,2]",
    "model.candidate_source_layer_id=1", "model.n_routed_experts=2",
    "model.num_experts_per_tok=2", "model.engram_layer_ids=[1]",
    "model.hc_mult=2", "model.max_ngram_size=3", "model.engram_vocab_size=[53,53]",
    "model.n_embed_per_ngram=32",
]
RUN = ["train.global_batch_size=2", "train.micro_batch_size=1", "train.seq_length=32",
       "train.lr_warmup_iters=0", "train.eval_interval=null", "train.log_interval=1",
       "train.seed=3", "system.memory_check=off"]


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))


def run(args: list[str], cwd: Path, torchrun: bool = False) -> str:
    """A shared command (``python -m ...``), on one process under torchrun when asked."""
    sys.path.insert(0, str(Path(__file__).parent))
    from launch import free_port, run_process

    head = [sys.executable]
    if torchrun:
        head += ["-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={free_port()}"]
    proc = run_process(head + args, cwd=cwd, env=env(), capture_output=True, text=True,
                       timeout=600)
    if proc.returncode:
        raise RuntimeError(f"{args}: exit {proc.returncode}\n{proc.stdout[-3000:]}"
                           f"{proc.stderr[-6000:]}")
    return proc.stdout + proc.stderr


def write_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer of the corpus's most frequent words and ``<|endoftext|>``."""
    from collections import Counter

    from tokenizers import Tokenizer, models, pre_tokenizers

    counts = Counter()
    for line in CORPUS.read_text().splitlines()[:DOCUMENTS]:
        counts.update(json.loads(line)["text"].split())
    vocab = {"<|endoftext|>": 0}
    for word, _ in counts.most_common(WORDS - 1):
        vocab[word] = len(vocab)
    vocab["[UNK]"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def write_data(folder: Path, tokenizer: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.jsonl"
    corpus.write_text("\n".join(CORPUS.read_text().splitlines()[:DOCUMENTS]) + "\n")
    run(["-m", "engram_train.data.preprocess", "--input", str(corpus), "--tokenizer",
         str(tokenizer), "--output-prefix", str(folder / "corpus"), "--no-progress"], folder)
    corpus.unlink()
    return folder / "corpus_text_document"


def train(out: Path, model: list[str], tokenizer: Path, data: Path, iters: int,
          load: Path | None = None, save: Path | None = None, extra=()) -> list[float]:
    """``engram-train`` for `iters` iterations; the losses of the iterations it ran."""
    exp = out / "exp"
    options = [a for a in extra if a.startswith("--")]  # Hydra's options before the overrides
    args = ["-m", "engram_train.train", *options, *model, *RUN, f"data.tokenizer={tokenizer}",
            f"data.path={data}", f"train.train_iters={iters}", f"experiment.exp_dir={exp}",
            f"checkpoint.save={save or out / 'checkpoints'}",
            *[a for a in extra if not a.startswith("--")]]
    if load is not None:
        args.append(f"checkpoint.load={load}")
    run(args, out, torchrun=True)
    lines = (exp / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["lm_loss"] for line in lines if '"lm_loss"' in line]


PLACEHOLDER = "@FIXTURES@"


def store_config(exp: Path, stored: Path, directory: Path) -> None:
    """The run's resolved config, the fixtures' folder written as `PLACEHOLDER`."""
    text = (exp / "config.yaml").read_text()
    stored.write_text(text.replace(str(directory), PLACEHOLDER))


def placed_config(stored: Path, directory: Path, out: Path) -> Path:
    """A stored config with `PLACEHOLDER` back at `directory`."""
    out.write_text(stored.read_text().replace(PLACEHOLDER, str(directory)))
    return out


def keep_first_save(checkpoint: Path) -> None:
    """Only the save at `SAVED_AT` (the same schedule's later save removed)."""
    shutil.rmtree(checkpoint / f"iter_{SAVED_AT + RESUMED_ITERS:07d}")
    (checkpoint / "latest_checkpointed_iteration.txt").write_text(str(SAVED_AT))
    (checkpoint / ".engram-train.lock").unlink(missing_ok=True)


def export(checkpoint: Path, out: Path, tokenizer: Path, config: Path) -> dict[str, str]:
    """``engram-export --format hf`` (`config`: the run's resolved config); sha256 of every
    file written."""
    run(["-m", "engram_train.export", "--load", str(checkpoint), "--out", str(out),
         "--format", "hf", "--tokenizer", str(tokenizer), "--config", str(config)], out.parent)
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


def import_hf(folder: Path, out: Path) -> None:
    run(["-m", "engram_train.hf.importer", "--hf", str(folder), "--out", str(out),
         "--seq-length", "32"], out.parent, torchrun=True)


def tensor_digests(checkpoint: Path) -> dict[str, str]:
    """sha256 of each model tensor of a checkpoint's newest iteration (the export's reader)."""
    sys.path.insert(0, str(REPO))
    from engram_train.export.checkpoint_reader import DistCheckpointReader
    from engram_train.export.locate import resolve_checkpoint

    _, directory, _ = resolve_checkpoint(checkpoint, None)
    reader = DistCheckpointReader(directory)
    digests = {}
    for key in reader.model_keys():
        if key.endswith("_extra_state"):
            continue
        stored = reader.tensors[key]
        value = reader.read_region(key, [0] * len(stored.shape), list(stored.shape))
        digests[key] = hashlib.sha256(value.contiguous().view(-1).view(
            __import__("torch").uint8).numpy().tobytes()).hexdigest()
    return digests


def preset_text(checkpoint: Path) -> str:
    """The imported preset, less its first line (the folder it was imported from)."""
    return (checkpoint / "conf" / "model" / "hf_import.yaml").read_text().split("\n", 1)[1]


def save(directory: Path) -> None:
    """Write the fixtures (module docstring) into `directory`, replacing what is there."""
    if directory.exists():
        shutil.rmtree(directory)
    work = directory.parent / (directory.name + ".work")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tokenizer = write_tokenizer(directory / "tokenizer")
    data = write_data(directory / "data", tokenizer)
    expected: dict = {}
    for name, model in (("v3", V3_MODEL), ("v41", V41_MODEL)):
        stored = directory / name
        (work / name).mkdir()
        train(work / name, model, tokenizer, data, SAVED_AT + RESUMED_ITERS, save=stored,
              extra=[f"checkpoint.save_interval={SAVED_AT}"])
        keep_first_save(stored)
        store_config(work / name / "exp", directory / f"{name}_config.yaml", directory)
        (work / f"{name}_resumed").mkdir()
        losses = train(work / f"{name}_resumed", model, tokenizer, data,
                       SAVED_AT + RESUMED_ITERS, load=stored)
        expected[f"{name}_resumed_losses"] = losses
        config = placed_config(directory / f"{name}_config.yaml", directory, work / "config.yaml")
        expected[f"{name}_export"] = export(stored, work / f"{name}_hf", tokenizer, config)
    # V3 without Engram: a stock deepseek_v3 folder, which engram-import-hf reads back
    (work / "v3_plain").mkdir()
    plain = work / "v3_plain" / "checkpoints"
    train(work / "v3_plain", V3_MODEL + ["model.use_engram=false"], tokenizer, data, SAVED_AT,
          save=plain)
    expected["v3_plain_export"] = export(plain, work / "v3_plain_hf", tokenizer,
                                         work / "v3_plain" / "exp" / "config.yaml")
    import_hf(work / "v3_plain_hf", directory / "v3_import")
    shutil.copytree(work / "v3_plain_hf", directory / "v3_plain_hf")
    expected["v3_import_tensors"] = tensor_digests(directory / "v3_import")
    expected["v3_import_preset"] = preset_text(directory / "v3_import")
    (work / "v3_import_resumed").mkdir()
    expected["v3_import_resumed_losses"] = train(
        work / "v3_import_resumed", ["model=hf_import"], tokenizer, data, RESUMED_ITERS,
        load=directory / "v3_import",
        extra=[f"--config-dir={directory / 'v3_import' / 'conf'}"])
    # V4.1: its released (quantized) export imported back
    import_hf(work / "v41_hf", work / "v41_import")
    expected["v41_import_tensors"] = tensor_digests(work / "v41_import")
    expected["v41_import_preset"] = preset_text(work / "v41_import")
    (directory / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    shutil.rmtree(work)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "save":
        save(Path(sys.argv[2]).resolve())
    else:
        raise SystemExit(__doc__)
