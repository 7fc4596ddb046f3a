"""The stage boundary of a pipelined DeepSeek-V4.1: which layers a stage holds, and the one
tensor megatron's schedules send from a stage to the next.

What a layer hands the next (the mHC streams, the float32 ``pre`` of single-pass mHC and the
CSA2 state: compressed KV, run validity, index keys, selection, candidates, ratio) crosses a
stage boundary whole, so any split of the layers is exact: a later stage's reuse and reindex
layers read the compressed KV of a full layer on an earlier stage, and its gradient goes back
with the streams' through megatron's P2P.

The boundary tensor is float32 ``[rows, b, hidden]``: per batch column, a header (each
slot's presence, rows, width and dtype, and the compression ratio), then the slots in order,
each ``[rows, width]`` flattened (`SLOTS`), zero-padded to whole rows of ``hidden``. Float32
holds every value exactly: bf16 streams and keys, the integer key ids (below 2^24), the bools
as 0/1. The sender concatenates and the receiver splits (no sums on either side), so the
gradients that come back (streams, ``pre``, compressed KV) are bit for bit the ones a single
process computes; the other slots carry none.

megatron's schedules allocate their receive buffers of ``config.pipeline_dtype`` and, with
``variable_seq_lengths``, learn each message's shape from the sender first (one 3-integer
message before each tensor): ``v41_config`` sets both (float32, True) when
``pipeline_model_parallel_size > 1``.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from engram_train.errors import ConfigError, InputError
from engram_train.models.deepseek_v41.v41_csa import CSAState

STATE_SLOTS = ("compressed_kv", "compressed_valid", "compressed_documents", "index_keys",
               "topk_indices", "candidates")
SLOTS = ("streams", "pre", *STATE_SLOTS)
"""What the boundary carries, in order: the streams ``[s, b, n h]``, ``pre`` ``[s, b, n]``, and
the `CSAState` fields (those not None)."""
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.bool, torch.int64)
_MAGIC = 4141.0
_HEADER = 2 + 4 * len(SLOTS)  # magic, ratio, then per slot: present, rows, width, dtype


def stage_layer_ids(num_layers: int, vp_stage: int | None = None) -> range:
    """The layers of this pipeline stage: megatron's even split (``num_layers`` divisible by
    the pipeline size, which the run config checks); all of them without a pipeline."""
    if vp_stage not in (None, 0) or (
            parallel_state.model_parallel_is_initialized()
            and parallel_state.get_virtual_pipeline_model_parallel_world_size() not in (None, 1)):
        raise ConfigError("model_family=deepseek_v41 runs no virtual pipeline "
                          "(virtual_pipeline_model_parallel_size=null).")
    if not parallel_state.model_parallel_is_initialized():
        return range(num_layers)
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    if num_layers % stages:
        raise ConfigError(f"num_hidden_layers={num_layers} must be divisible by "
                          f"pipeline_model_parallel_size={stages}.")
    share = num_layers // stages
    rank = parallel_state.get_pipeline_model_parallel_rank()
    return range(rank * share, (rank + 1) * share)


def _as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``[rows, b]`` or ``[rows, b, ...]`` -> ``[rows, b, width]``."""
    return tensor.unsqueeze(-1) if tensor.ndim == 2 else tensor.flatten(2)


def pack_boundary(streams: torch.Tensor, pre: torch.Tensor, state: CSAState,
                  hidden_size: int) -> torch.Tensor:
    """The float32 ``[rows, b, hidden_size]`` tensor of a stage's output (module docstring)."""
    from megatron.core.utils import make_viewless_tensor

    b = streams.shape[1]
    slots = dict(streams=streams.flatten(2), pre=pre,
                 **{name: getattr(state, name) for name in STATE_SLOTS})
    header, pieces = [_MAGIC, float(state.compression_ratio)], []
    for name in SLOTS:
        tensor = slots[name]
        if tensor is None:
            header += [0.0, 0.0, 0.0, 0.0]
            continue
        rows = _as_rows(tensor)
        header += [1.0, float(rows.shape[0]), float(rows.shape[2]),
                   float(_DTYPES.index(tensor.dtype))]
        pieces.append(rows.to(torch.float32).transpose(0, 1).reshape(b, -1))
    head = torch.tensor(header, dtype=torch.float32, device=streams.device).expand(b, -1)
    flat = torch.cat([head, *pieces], dim=1)
    flat = torch.nn.functional.pad(flat, (0, -flat.shape[1] % hidden_size))
    packed = flat.view(b, -1, hidden_size).transpose(0, 1).contiguous()
    return make_viewless_tensor(inp=packed, requires_grad=packed.requires_grad, keep_graph=True)


def unpack_boundary(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, CSAState]:
    """``(streams [s, b, n, h], pre [s, b, n], state)`` of a received boundary tensor."""
    if packed is None or packed.ndim != 3 or packed.dtype != torch.float32:
        raise InputError("a DeepSeek-V4.1 stage after the first needs the previous stage's "
                         "float32 boundary tensor (megatron's set_input_tensor).")
    b = packed.shape[1]
    flat = packed.transpose(0, 1).reshape(b, -1)
    header = flat[0, :_HEADER].tolist()
    if header[0] != _MAGIC:
        raise InputError("the pipeline input is not a DeepSeek-V4.1 boundary tensor "
                         "(models/deepseek_v41/v41_pipeline.py).")
    records = [header[2 + 4 * i: 6 + 4 * i] for i in range(len(SLOTS))]
    sizes = [int(rows * width) for present, rows, width, _ in records if present]
    parts = torch.split(flat, [_HEADER, *sizes, flat.shape[1] - _HEADER - sum(sizes)], dim=1)
    values, taken = {}, iter(parts[1:-1])
    for name, (present, rows, width, dtype) in zip(SLOTS, records):
        if not present:
            values[name] = None
            continue
        rows_view = next(taken).reshape(b, int(rows), int(width)).transpose(0, 1)
        kind = _DTYPES[int(dtype)]
        value = rows_view != 0 if kind == torch.bool else rows_view.to(kind)
        values[name] = (value.squeeze(-1) if name in ("compressed_valid", "compressed_documents")
                        else value)
    pre = values.pop("pre")
    streams = values.pop("streams").unflatten(-1, (pre.shape[-1], -1))
    return streams, pre, CSAState(**values, compression_ratio=int(header[1]))
