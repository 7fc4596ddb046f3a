"""DeepSeek-V4.1 checkpoint keys <-> the released tensor names (NeMo Automodel's state-dict
adapter ``to_hf``), one table for both directions: DeepSeek-V4.1's `HFMapping.pieces`.

A checkpoint tensor (its dist-checkpoint key and global shape) holds one or more *pieces*
(``models/hf_mapping.Piece``: an axis-aligned block that is one released tensor):

- ``embedding.word_embeddings.weight`` / ``output_layer.weight``: ``embed.weight`` /
  ``head.weight``, their first ``vocab_size`` rows (megatron pads the vocabulary);
- ``final_norm.weight``: ``norm.weight``;
- ``layers.<i>.attn_hc.{fn,base,scale}`` / ``ffn_hc.*``: ``layers.<i>.hc_attn_*`` /
  ``hc_ffn_*``;
- ``layers.<i>.ffn.gate.e_score_correction_bias``: ``layers.<i>.ffn.gate.bias``;
- the stacked routed experts ``layers.<i>.ffn.experts.w{1,2,3}`` ``[E, ...]``: one piece per
  expert, ``layers.<i>.ffn.experts.<e>.w{1,2,3}.weight``;
- ``layers.<i>.engram.multi_head_embedding.weight``: ``layers.<i>.engram.embed.weight`` (the
  table of sum(primes) rows); its ``offsets`` follow from the config (no released tensor);
- the attention (its compressor and indexer included), the norms, the router's weight, the
  shared expert and the Engram projections keep their names.

Released tensors the model does not hold (`skipped_kind`): the DSpark/MTP draft (``mtp.*``)
and the vision side (``vision.*``, ``aligner.*``, ``image_{start,end,newline}`` and each
layer's ``ffn.gate.bias_vl``, the router's bias for image tokens).
"""

from __future__ import annotations

import re

from engram_train.models.hf_mapping import Piece, UnmappedTensorError, whole

DERIVED = None
"""What `v41_pieces` returns for a checkpoint tensor the config determines (the Engram
table's row offsets): no released tensor, kept as the model builds it."""

_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_KEPT = re.compile(
    r"^(attn\.[a-z_.]*weight|attn_norm\.weight|ffn_norm\.weight|ffn\.gate\.weight"
    r"|ffn\.shared_experts\.w[123]\.weight|engram\.(wkv\.weight|q_weight|k_weight))$")
_HC = re.compile(r"^(attn|ffn)_hc\.(fn|base|scale)$")
_EXPERT = re.compile(r"^ffn\.experts\.(w[123])$")
_RENAMED = {
    "attn.attn_sink": "attn.attn_sink",
    "ffn.gate.e_score_correction_bias": "ffn.gate.bias",
    "engram.multi_head_embedding.weight": "engram.embed.weight",
}
_VISION = re.compile(r"^(vision\.|aligner\.|image_(start|end|newline)$|layers\.\d+\.ffn\.gate\.bias_vl$)")
VISION_BIAS = "ffn.gate.bias_vl"
"""Each layer's router bias for image tokens: zeros at NeMo's init, not in the text model."""


def v41_pieces(key: str, shape: tuple[int, ...], vocab_size: int) -> list[Piece] | None:
    """The released tensors that checkpoint tensor `key` (global shape `shape`) holds, or
    `DERIVED`; `vocab_size`: the rows of the embedding and head that are released."""
    shape = tuple(int(d) for d in shape)
    if key == "embedding.word_embeddings.weight":
        return [Piece("embed.weight", (0, 0), (vocab_size, shape[1]))]
    if key == "output_layer.weight":
        return [Piece("head.weight", (0, 0), (vocab_size, shape[1]))]
    if key == "final_norm.weight":
        return whole("norm.weight", shape)
    match = _LAYER_KEY.match(key)
    if match is None:
        raise UnmappedTensorError(f"{key}: no DeepSeek-V4.1 released name for this checkpoint "
                                  "tensor")
    prefix, rest = f"layers.{match.group(1)}.", match.group(2)
    if rest == "engram.multi_head_embedding.offsets":
        return DERIVED
    if rest in _RENAMED:
        return whole(prefix + _RENAMED[rest], shape)
    if hc := _HC.match(rest):
        return whole(f"{prefix}hc_{hc.group(1)}_{hc.group(2)}", shape)
    if expert := _EXPERT.match(rest):
        return [Piece(f"{prefix}ffn.experts.{e}.{expert.group(1)}.weight", (e, 0, 0),
                      (1, *shape[1:]), True) for e in range(shape[0])]
    if _KEPT.match(rest):
        return whole(prefix + rest, shape)
    raise UnmappedTensorError(f"{key}: no DeepSeek-V4.1 released name for this checkpoint tensor")


def skipped_kind(name: str) -> str | None:
    """'mtp' or 'vision' for a released tensor the model does not hold, else None."""
    if name.startswith("mtp."):
        return "mtp"
    if _VISION.match(name):
        return "vision"
    return None
