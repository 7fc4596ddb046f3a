"""NeMo Automodel 0.7.0's DeepSeek-V4.1, the reference of the V4.1 tests, run in this process.

NeMo and the transformers it pins (5.18.0; the project's environment holds 5.24.0) live in the
side folder ``.v41-ref`` (``make v41-ref`` installs it; ``make test`` does when it is missing).
Both lanes use the same folder: it holds pure-Python packages only, and everything else NeMo's
V4.1 modules import on the CPU (torch, tokenizers, safetensors, huggingface_hub, numpy,
pydantic, PIL, ...) comes from the lane's environment.

Other test files of the same pytest process import the environment's transformers, so the side
folder's packages are only visible inside ``with side():``, which swaps them into
``sys.modules`` (and the folder onto ``sys.path``) and swaps the environment's back on exit,
restoring the environment variables and warning filters NeMo's imports set. Build and run every
NeMo object inside it; what leaves it is plain tensors (and modules whose forward is torch only).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SIDE = REPO / ".v41-ref"
PINS = ("transformers==5.18.0", "nemo-automodel==0.7.0")
TOKENIZER = REPO / "examples" / "data" / "tokenizer" / "tokenizer.json"
_OWNED = ("transformers", "nemo_automodel")
_side_modules: dict[str, object] = {}


def require() -> None:
    """Fail (never skip) with the command that installs the side folder."""
    missing = [name for name in _OWNED if not (SIDE / name / "__init__.py").is_file()]
    if missing:
        pytest.fail(
            f"the DeepSeek-V4.1 reference is not installed: {SIDE} lacks {', '.join(missing)}. "
            f"`make v41-ref` installs it (pip install --no-deps --target .v41-ref {' '.join(PINS)}).",
            pytrace=False,
        )


def _owned(name: str) -> bool:
    return name.split(".", 1)[0] in _OWNED


SELECTING_MODULE = "nemo_automodel.components.models.deepseek_v41.attention"
"""The NeMo module whose top-k calls are CSA2 selections (its MoE router's are left alone)."""


def _tie_defined_topk(original):
    """``Tensor.topk`` with the project's tie rule (equal values: the lower index first) for
    the calls NeMo's CSA2 selection makes (`SELECTING_MODULE`). There NeMo uses
    ``torch.topk``, whose choice among equal scores depends on the width of the row (NeMo's
    ``_select_packed`` says so); the tiny models' two index heads give many scores of exactly 0
    (relu), so without a defined rule the two sides' selections differ where the reference's
    own choice is arbitrary."""
    from engram_train.models.deepseek_v41.v41_csa import ordered_top

    def topk(values, k, dim=-1, largest=True, sorted=True, **kwargs):
        if (sys._getframe(1).f_globals.get("__name__") != SELECTING_MODULE
                or not values.is_floating_point() or not largest or kwargs
                or dim not in (-1, values.ndim - 1)):
            return original(values, k, dim, largest, sorted, **kwargs)
        indices = ordered_top(values, k, sorted=sorted)
        return torch.return_types.topk((values.gather(-1, indices), indices))

    return topk


@contextlib.contextmanager
def tie_defined_topk():
    """`_tie_defined_topk` in place of ``Tensor.topk`` for the duration."""
    original = torch.Tensor.topk
    torch.Tensor.topk = _tie_defined_topk(original)
    try:
        yield
    finally:
        torch.Tensor.topk = original


@contextlib.contextmanager
def side():
    """The side folder's transformers and NeMo in ``sys.modules`` for the duration, with the
    ties of NeMo's CSA2 selections defined as the project defines them (`tie_defined_topk`)."""
    require()
    outer = {name: sys.modules.pop(name) for name in list(sys.modules) if _owned(name)}
    environ = dict(os.environ)
    sys.modules.update(_side_modules)
    sys.path.insert(0, str(SIDE))
    importlib.invalidate_caches()
    try:
        with warnings.catch_warnings(), tie_defined_topk():
            yield
    finally:
        sys.path.remove(str(SIDE))
        _side_modules.clear()
        _side_modules.update({name: sys.modules.pop(name) for name in list(sys.modules)
                              if _owned(name)})
        sys.modules.update(outer)
        importlib.invalidate_caches()
        os.environ.clear()
        os.environ.update(environ)


def tokenizer(path: Path = TOKENIZER):
    """transformers' ``PreTrainedTokenizerFast`` of a ``tokenizer.json`` (inside ``side()``)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(path))


def compressed_token_map(path: Path = TOKENIZER) -> tuple[list[int], int]:
    """NeMo's ``_compressed_token_map``: raw id -> compressed id, and the compressed size."""
    with side():
        from nemo_automodel.components.models.deepseek_v41.engram import _compressed_token_map

        token_map, size = _compressed_token_map(tokenizer(path))
    return list(token_map), size


def text_config(args, hidden_size: int, path: Path = TOKENIZER, **extra):
    """A ``DeepseekV41TextConfig`` carrying `args` (``DeepseekV41EngramArgs``), ``dtype``
    float32 and the compressed size and row counts filled in (inside ``side()``)."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig
    from nemo_automodel.components.models.deepseek_v41.engram import (
        _compressed_token_map,
        _next_prime,
    )

    layers = list(args.engram_layer_ids)
    n, heads = args.engram_max_ngram_size, args.engram_n_heads
    seen, rows = set(), []  # the reference's own prime walk (one seen set over all layers)
    for _ in layers:
        total = 0
        for _ in range(n - 1):
            prime = args.engram_vocab_size - 1
            for _ in range(heads):
                prime = _next_prime(prime, seen)
                seen.add(prime)
                total += prime
        rows.append(total)
    num_layers = max(layers) + 1
    fields = dict(
        vocab_size=len(tokenizer(path)), hidden_size=hidden_size, num_hidden_layers=num_layers,
        compress_ratios=[0] * num_layers, kv_source_layer_ids=[], index_source_layer_ids=[],
        candidate_source_layer_id=-1, hc_mult=args.hc_mult, rms_norm_eps=args.rms_norm_eps,
        initializer_range=args.initializer_range, engram_layer_ids=layers,
        engram_num_embeddings=rows, engram_max_ngram_size=n, engram_vocab_size=args.engram_vocab_size,
        engram_n_heads=heads, engram_head_dim=args.engram_head_dim,
        engram_pad_token_id=args.engram_pad_token_id,
        engram_compressed_vocab_size=_compressed_token_map(tokenizer(path))[1],
        num_nextn_predict_layers=0, dspark_noise_token_id=0, dtype="float32",
    )
    fields.update(extra)
    return DeepseekV41TextConfig(**fields)


def ngram_hash(args, input_ids, token_mask=None, sequence_ids=None, path: Path = TOKENIZER):
    """NeMo's ``DeepseekV41NgramHash`` of torch [B, T] ids: table rows [B, T, L, K]."""
    with side():
        from nemo_automodel.components.models.deepseek_v41.engram import DeepseekV41NgramHash

        module = DeepseekV41NgramHash(text_config(args, 64, path), tokenizer(path))
        return module(input_ids, token_mask=token_mask, sequence_ids=sequence_ids)


def engram(args, hidden_size: int, layer_id: int):
    """NeMo's ``DeepseekV41Engram`` of `layer_id`, float32, one process (full table), with the
    CPU backend (linear "torch")."""
    with side():
        from nemo_automodel.components.models.common import BackendConfig
        from nemo_automodel.components.models.deepseek_v41.engram import DeepseekV41Engram

        backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", rope="torch",
                                experts="torch", dispatcher="torch")
        return DeepseekV41Engram(text_config(args, hidden_size), layer_id, backend)
