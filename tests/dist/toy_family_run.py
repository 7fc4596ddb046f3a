"""The toy family (tests/toy_family/, registered by importing it) through the shared commands'
Python entry points, one phase per process (tests/test_toy_family.py):

- ``--phase import``: writes a tiny ``toy_dense`` transformers folder (seeded weights, the
  stored fixtures' word-level tokenizer) and runs ``engram-import-hf``'s ``import_hf``;
- ``--phase train``: one step of the trainer (``engram_train.train.run``) from the import, the
  model section its preset, saved at iteration 1;
- ``--phase export``: ``engram-export --format hf``'s ``export_hf`` of the import and of the
  trained checkpoint.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))

import torch  # noqa: E402
from common import parse_args, write_result  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import toy_family  # noqa: E402,F401  (registers toy_dense)

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "before_family_registry"
TOKENIZER = FIXTURES / "tokenizer" / "tokenizer.json"
DATA = FIXTURES / "data" / "corpus_text_document"
SIZES = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=64, vocab_size=128)  # the tokenizer's 100 ids, padded


def write_folder(folder: Path) -> None:
    """config.json, model.safetensors (seeded values of order 0.1, norms near 1), tokenizer."""
    import shutil

    h, f, n = SIZES["hidden_size"], SIZES["intermediate_size"], SIZES["num_hidden_layers"]
    heads, groups = SIZES["num_attention_heads"], SIZES["num_key_value_heads"]
    qkv = (heads + 2 * groups) * (h // heads)
    g = torch.Generator().manual_seed(11)
    shapes = {"model.embed_tokens.weight": (SIZES["vocab_size"], h),
              "lm_head.weight": (SIZES["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(n):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.qkv_proj.weight": (qkv, h),
                       p + "self_attn.o_proj.weight": (h, h),
                       p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.gate_up_proj.weight": (2 * f, h), p + "mlp.down_proj.weight": (h, f)})
    tensors = {name: (1 + 0.1 * torch.randn(shape, generator=g)) if len(shape) == 1
               else 0.1 * torch.randn(shape, generator=g) for name, shape in shapes.items()}
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"), {"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "toy_dense", **SIZES}))
    shutil.copy(TOKENIZER, folder / "tokenizer.json")


def import_phase(work: Path) -> dict:
    from engram_train.hf.importer import import_hf

    write_folder(work / "hf")
    preset = import_hf(work / "hf", work / "imported", seq_length=32, log=lambda _: None)
    return {"preset": str(preset)}


def train_phase(work: Path) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    from engram_train.config import register
    from engram_train.models.presets import CONF_DIR
    from engram_train.train import run

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("train", overrides=[
            f"data.tokenizer={TOKENIZER}", f"data.path={DATA}", "train.train_iters=1",
            "train.global_batch_size=2", "train.micro_batch_size=1", "train.seq_length=32",
            "train.lr_warmup_iters=0", "train.eval_interval=null", "train.log_interval=1",
            f"checkpoint.load={work / 'imported'}", f"checkpoint.save={work / 'run'}",
            f"experiment.exp_dir={work / 'exp'}"])
    with open_dict(cfg):
        cfg.model = OmegaConf.load(work / "imported" / "conf" / "model" / "hf_import.yaml")
    last = run(cfg)
    return {"lm_loss": float(last["lm_loss"])}


def export_phase(work: Path) -> dict:
    from engram_train.export.hf_export import export_hf

    export_hf(work / "imported", work / "hf_imported", tokenizer=TOKENIZER, log=lambda _: None)
    export_hf(work / "run", work / "hf_trained", config=work / "exp" / "config.yaml",
              tokenizer=TOKENIZER, log=lambda _: None)
    return {}


if __name__ == "__main__":
    args = parse_args({"--phase": dict(required=True), "--work": dict(required=True)})
    phase = {"import": import_phase, "train": train_phase, "export": export_phase}[args.phase]
    write_result(args.out, phase(Path(args.work)))
