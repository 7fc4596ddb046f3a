"""Golden reference cases (see tests/data/golden/README.md): discovery and config building.

Cases live in `$ENGRAM_GOLDEN_DIR` (default: tests/data/golden next to this file). A case is
`<case>_meta.json` + `<case>_hash.safetensors` + `<case>_engram_layer<L>_hc<G>.safetensors`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from engram_train.config import EngramConfig

GOLDEN_DIR = Path(
    os.environ.get("ENGRAM_GOLDEN_DIR") or Path(__file__).resolve().parent / "data" / "golden"
)
MODULE_PREFIX = "engram_layer"


def case_names() -> list[str]:
    """Every case with a `<case>_meta.json` in GOLDEN_DIR, sorted."""
    return sorted(p.name[: -len("_meta.json")] for p in GOLDEN_DIR.glob("*_meta.json"))


def load_meta(case: str) -> dict:
    return json.loads((GOLDEN_DIR / f"{case}_meta.json").read_text())


def module_cases() -> list[tuple[str, str]]:
    """(case, "engram_layer<L>_hc<G>") for every module entry of every case."""
    return [
        (case, key)
        for case in case_names()
        for key in sorted(load_meta(case))
        if key.startswith(MODULE_PREFIX)
    ]


def tokenizer_path(meta: dict) -> Path:
    return GOLDEN_DIR / meta["tokenizer"]


def engram_config(meta: dict, hc_mult: int = 1) -> EngramConfig:
    """The EngramConfig a case was generated with."""
    return EngramConfig(
        use_engram=True,
        engram_tokenizer_name_or_path=str(tokenizer_path(meta)),
        engram_vocab_size=list(meta["engram_vocab_size"]),
        max_ngram_size=meta["max_ngram_size"],
        n_embed_per_ngram=meta["n_embed_per_ngram"],
        n_head_per_ngram=meta["n_head_per_ngram"],
        engram_layer_ids=list(meta["layer_ids"]),
        engram_pad_id=meta["pad_id"],
        engram_seed=meta["seed"],
        engram_kernel_size=meta["kernel_size"],
        engram_hc_mult=hc_mult,
    )
