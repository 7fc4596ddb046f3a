"""Load weights saved by DeepSeek's reference Engram module (`engram_demo_v1.py`).

Our submodules carry the reference's names; only the table differs: the reference's
`multi_head_embedding.embedding.weight` is our `multi_head_embedding.weight`, and on a
sharded table only this rank's rows [row_start, row_end) are copied.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from engram_train.engram.engram_module import Engram
from engram_train.errors import InputError

REFERENCE_TABLE = "multi_head_embedding.embedding.weight"
PROJECT_TABLE = "multi_head_embedding.weight"
OFFSETS = "multi_head_embedding.offsets"


def project_name(reference_name: str) -> str:
    """Reference parameter/buffer name -> ours."""
    return PROJECT_TABLE if reference_name == REFERENCE_TABLE else reference_name


def reference_name(name: str) -> str:
    """Our parameter/buffer name -> the reference's."""
    return REFERENCE_TABLE if name == PROJECT_TABLE else name


@torch.no_grad()
def load_reference_state_dict(
    engram: Engram, state_dict: Mapping[str, torch.Tensor | np.ndarray], strict: bool = True
) -> None:
    """Copy reference tensors into `engram`, checking names, shapes and head offsets.

    The offsets must equal ours: a mismatch means the config (vocab sizes, heads, layer ids)
    differs from the one the weights were trained with.
    """
    ours = dict(engram.named_parameters())
    unknown, mismatched = [], []
    seen = set()
    for ref_name, value in state_dict.items():
        value = torch.as_tensor(value)
        name = project_name(ref_name)
        if name == OFFSETS:
            expected = engram.multi_head_embedding.offsets
            if not torch.equal(value.to(expected.device, torch.int64), expected):
                raise InputError(
                    f"{ref_name} {value.tolist()} differ from this module's {expected.tolist()}:"
                    " engram_vocab_size, n_head_per_ngram, max_ngram_size or engram_layer_ids "
                    "differ from the checkpoint's config; use the same values."
                )
            continue
        if name not in ours:
            unknown.append(ref_name)
            continue
        param = ours[name]
        seen.add(name)
        if name == PROJECT_TABLE:
            table = engram.multi_head_embedding
            if tuple(value.shape) != (table.num_rows, table.embedding_dim):
                mismatched.append(
                    f"{ref_name}: checkpoint {tuple(value.shape)} vs table "
                    f"({table.num_rows}, {table.embedding_dim})"
                )
                continue
            value = value[table.row_start : table.row_end]
        elif value.shape != param.shape:
            mismatched.append(
                f"{ref_name}: checkpoint {tuple(value.shape)} vs {tuple(param.shape)}"
            )
            continue
        param.copy_(value)
    problems = []
    if mismatched:
        problems.append(
            "shape mismatch (check hidden_size, engram_hc_mult, n_embed_per_ngram, "
            f"engram_kernel_size): {mismatched}"
        )
    if strict and unknown:
        problems.append(f"unexpected reference names: {unknown}")
    missing = sorted(set(ours) - seen)
    if strict and missing:
        problems.append(f"missing from the checkpoint: {[reference_name(n) for n in missing]}")
    if problems:
        raise InputError("load_reference_state_dict: " + "; ".join(problems))
