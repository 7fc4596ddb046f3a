"""Engram on transformers' DeepSeek-V3: ``EngramDeepseekV3ForCausalLM`` and its config.

transformers' own DeepSeek-V3 classes with Engram added at ``engram_layer_ids``: those decoder
layers first add ``Engram(h)`` to their input (``h = h + Engram(h, hash ids)``, as the
trainer's Engram layer), then run the stock layer. The Engram branch is the project's
`Engram` module, so its numerics are the trainer's; the hash constants are int64 buffers of
the model (``model.engram_hash.*``), loaded with the weights.

Cached decoding equals full recomputation: the n-gram hash of a new token reads the last N-1
compressed ids of its sequence and the short conv its last (K-1)*N normalized values; both are
kept with the KV cache (``cache.engram_state``) and start from pad ids and zeros, as the
trainer's padding does. Without a cache every call starts a new sequence. Left padding
(``attention_mask`` zeros before a row's tokens) is skipped by both: a batched row decodes as
it does alone. Right padding is refused.

This file depends on torch, numpy, transformers and the modules it imports from the package,
which depend on torch and numpy only: ``engram-export --format hf`` writes it (and them) into
the folder, so that ``trust_remote_code=True`` loads the folder without this project.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers import initialization as init
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3ForCausalLM,
    DeepseekV3Model,
)

# The package modules below depend on torch and numpy only; the export copies them (and this
# file) into the folder with these imports made relative (engram_train/hf/remote_code.py).
from engram_train.engram.engram_module import Engram, ShortConv
from engram_train.errors import InputError
from engram_train.hf.configuration import MODEL_TYPE, EngramDeepseekV3Config
from engram_train.engram.incremental_hash import (
    IncrementalNgramHasher,
    continue_document_distance,
)
from engram_train.models.hyper_connection import HyperConnection, HyperHead, scale_index


def _engram_fields(config: EngramDeepseekV3Config) -> SimpleNamespace | None:
    """The Engram fields of the config (None: no Engram)."""
    fields = dict(config.engram or {})
    if not fields:
        return None
    missing = [k for k in ("engram_layer_ids", "max_ngram_size", "n_head_per_ngram",
                           "n_embed_per_ngram", "num_raw_ids", "table_rows") if k not in fields]
    if missing:
        raise InputError(f"config.engram lacks {missing}: export the model with engram-export "
                         "--format hf")
    fields.setdefault("engram_reset_at_eos", False)
    if fields.get("engram_hc_mult") is None:  # follows the backbone (config.resolve's rule)
        fields["engram_hc_mult"] = _num_streams(config)
    return SimpleNamespace(**fields)


def _num_streams(config: EngramDeepseekV3Config) -> int:
    """mHC's residual streams (1: the plain residual)."""
    return int(config.hyper_connections.get("num_residual_streams", 1))


def _expand(hidden_states: torch.Tensor, streams: int) -> torch.Tensor:
    """[B, T, d] -> [B, T, n, d], every stream the embedding (the trainer's expansion); the
    streams as they are when already expanded."""
    if streams == 1 or hidden_states.ndim == 4:
        return hidden_states
    return hidden_states.unsqueeze(2).expand(*hidden_states.shape[:2], streams,
                                             hidden_states.shape[-1]).contiguous()


class EngramHash(nn.Module):
    """The hash constants as buffers (exact int64), and the incremental hasher built on them."""

    def __init__(self, fields: SimpleNamespace) -> None:
        super().__init__()
        self.fields = fields
        self.layer_ids = sorted(int(i) for i in fields.engram_layer_ids)
        heads = (fields.max_ngram_size - 1) * fields.n_head_per_ngram
        self.register_buffer("lookup", torch.zeros(fields.num_raw_ids, dtype=torch.int64))
        for layer in self.layer_ids:
            self.register_buffer(f"multipliers_{layer}",
                                 torch.zeros(fields.max_ngram_size, dtype=torch.int64))
            self.register_buffer(f"primes_{layer}", torch.zeros(heads, dtype=torch.int64))
        self._hasher = None

    def hasher(self) -> IncrementalNgramHasher:
        if self._hasher is None:  # the buffers hold the loaded constants by now
            f = self.fields
            self._hasher = IncrementalNgramHasher(
                self.lookup.cpu().numpy(),
                {i: getattr(self, f"multipliers_{i}").cpu().numpy() for i in self.layer_ids},
                {i: getattr(self, f"primes_{i}").cpu().numpy() for i in self.layer_ids},
                f.max_ngram_size, f.n_head_per_ngram, pad_id=f.compressed_pad_id,
                eos_id=f.engram_eos_id if f.engram_reset_at_eos else None)
        return self._hasher

    def _load_from_state_dict(self, *args, **kwargs):
        self._hasher = None
        super()._load_from_state_dict(*args, **kwargs)


class EngramTable(nn.Module):
    """A layer's Engram table for inference: ``weight`` [rows, head_dim] (all heads' rows
    concatenated) and each head's first row ``offsets``, as the trainer's
    ``MultiHeadEmbedding`` stores them; head-local hashes [..., K] -> memory [..., K * head_dim]."""

    def __init__(self, rows: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, head_dim))
        self.register_buffer("offsets", torch.zeros(num_heads, dtype=torch.int64))

    def forward(self, hash_ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight[hash_ids + self.offsets]
        return rows.reshape(*hash_ids.shape[:-1], -1)


class StreamingShortConv(nn.Module):
    """`ShortConv` that continues from per-sequence state instead of zero left padding, and
    skips padding positions: their normalized values are zero, as the left padding of a
    sequence that starts later (exact for left-padded rows). With ``document_distance`` [S, B]
    (``engram_reset_at_eos``) the look-back stops at each position's document start, the
    state's values included (`ShortConv.forward`).

    The conv is causal with dilation N and kernel K, so the output at t reads normalized values
    t - (K-1)*N .. t: those (K-1)*N values are the state."""

    def __init__(self, conv: ShortConv, state: torch.Tensor, keep: torch.Tensor | None) -> None:
        super().__init__()
        self.inner = conv
        self.state = state  # [B, G*d, (K-1)*N]
        self.keep = keep    # [B, S] bool, or None: every position is a token

    def forward(self, x: torch.Tensor, left_context: torch.Tensor | None = None,
                document_distance: torch.Tensor | None = None) -> torch.Tensor:
        if left_context is not None:
            raise InputError("StreamingShortConv continues from its state: no left_context")
        seq, batch, streams, width = x.shape
        normed = self.inner.normalize(x).permute(1, 2, 0)  # [B, G*d, S]
        if self.keep is not None:
            normed = normed * self.keep[:, None, :].to(normed.dtype)
        y = torch.cat([self.state, normed], dim=-1)  # [B, G*d, state + S]
        self.state = y[..., y.shape[-1] - self.inner.left_pad:].clone()
        if document_distance is None:
            y = self.inner.conv(y)
        else:
            if document_distance.shape != (seq, batch):
                raise InputError(f"document_distance {tuple(document_distance.shape)} must be "
                                 f"[S, B] = [{seq}, {batch}]")
            y = self.inner._conv_within_documents(y, document_distance)
        y = nn.functional.silu(y)
        return y.permute(2, 0, 1).reshape(seq, batch, streams, width)


@dataclass
class EngramCacheState:
    """What decoding carries per sequence besides the KV cache."""

    history: np.ndarray                 # [B, N-1] last compressed ids
    conv: dict[int, torch.Tensor]       # layer -> [B, G*d, (K-1)*N] last normalized values
    tokens: int = 0
    since_start: np.ndarray | None = None  # [B] next token's place in its document (EOS reset)


class HyperConnectionDecoderLayer(DeepseekV3DecoderLayer):
    """A DeepSeek-V3 decoder layer on n residual streams: its attention and MLP/MoE read
    ``u = H_pre X`` and write back ``X' = H_post y + C X`` (the project's `HyperConnection`,
    the trainer's ``HyperConnectionTransformerLayer``); streams are [B, T, n, d]."""

    def __init__(self, config: EngramDeepseekV3Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        hc = config.hyper_connections
        self.num_streams = int(hc["num_residual_streams"])
        self.attn_hc, self.ffn_hc = (
            HyperConnection(config.hidden_size, self.num_streams, int(hc["sinkhorn_iterations"]),
                            norm_eps=float(hc["norm_eps"])) for _ in range(2))

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        x = _expand(hidden_states, self.num_streams)
        u, h_post, mixing = self.attn_hc(x)
        y, _ = self.self_attn(hidden_states=self.input_layernorm(u), **kwargs)
        x = self.attn_hc.mix(x, y, h_post, mixing)
        u, h_post, mixing = self.ffn_hc(x)
        return self.ffn_hc.mix(x, self.mlp(self.post_attention_layernorm(u)), h_post, mixing)


class _EngramInput:
    """Mixin for a decoder layer: its input first receives the Engram memory."""

    num_streams = 1

    def _add_engram(self, config: EngramDeepseekV3Config, layer_idx: int) -> None:
        fields = _engram_fields(config)
        heads = (fields.max_ngram_size - 1) * fields.n_head_per_ngram
        table = EngramTable(int(fields.table_rows[str(layer_idx)]), heads,
                            fields.n_embed_per_ngram // fields.n_head_per_ngram)
        self.engram = Engram(fields, config.hidden_size, layer_idx, table=table)
        # (hash ids [T, B, K], decoding state, kept positions [B, T] or None, document
        # distances [T, B] or None): set per call
        self.engram_step: tuple[torch.Tensor, EngramCacheState, torch.Tensor | None,
                                torch.Tensor | None] | None = None

    def engram_output(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Engram(h) for [B, T, d] (or the [B, T, n, d] streams); advances this layer's conv
        state in `engram_step`."""
        hash_ids, state, keep, distance = self.engram_step
        layer = self.engram.layer_id
        conv = self.engram.short_conv
        streaming = StreamingShortConv(conv, state.conv[layer].to(hidden_states.dtype),
                                       None if keep is None else keep.to(hidden_states.device))
        self.engram._modules["short_conv"] = streaming
        try:
            memory = self.engram.multi_head_embedding(hash_ids.to(hidden_states.device))
            y = self.engram(hidden_states.transpose(0, 1).contiguous(), memory=memory,
                            document_distance=None if distance is None else distance.to(
                                hidden_states.device))
        finally:
            self.engram._modules["short_conv"] = conv
        state.conv[layer] = streaming.state
        return y.transpose(0, 1)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        hidden_states = _expand(hidden_states, self.num_streams)
        hidden_states = hidden_states + self.engram_output(hidden_states)
        return super().forward(hidden_states, *args, **kwargs)


class EngramDeepseekV3DecoderLayer(_EngramInput, DeepseekV3DecoderLayer):
    """A DeepSeek-V3 decoder layer whose input first receives the Engram memory."""

    def __init__(self, config: EngramDeepseekV3Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self._add_engram(config, layer_idx)


class EngramHyperConnectionDecoderLayer(_EngramInput, HyperConnectionDecoderLayer):
    """The mHC layer with Engram on all n streams (``engram_hc_mult`` = n)."""

    def __init__(self, config: EngramDeepseekV3Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self._add_engram(config, layer_idx)


class EngramDeepseekV3Model(DeepseekV3Model):
    """DeepSeek-V3 with Engram layers at ``engram_layer_ids`` (and the hash constants) and/or
    mHC: every layer on n streams, expanded from the embedding and collapsed by ``hc_head``
    before the final norm."""

    config_class = EngramDeepseekV3Config

    def __init__(self, config: EngramDeepseekV3Config) -> None:
        super().__init__(config)
        fields, streams = _engram_fields(config), _num_streams(config)
        self.engram_hash = EngramHash(fields) if fields is not None else None
        engram_layers = set(self.engram_hash.layer_ids) if fields is not None else set()
        for layer in engram_layers:
            if not 0 <= layer < config.num_hidden_layers:
                raise InputError(f"engram_layer_ids has {layer}, outside the model's "
                                 f"{config.num_hidden_layers} layers")
        classes = {(True, False): EngramDeepseekV3DecoderLayer,
                   (False, True): HyperConnectionDecoderLayer,
                   (True, True): EngramHyperConnectionDecoderLayer}
        for layer in range(config.num_hidden_layers):
            kind = classes.get((layer in engram_layers, streams > 1))
            if kind is not None:
                self.layers[layer] = kind(config, layer)
        if streams > 1:
            self.hc_head = HyperHead(config.hidden_size, streams,
                                     norm_eps=float(config.hyper_connections["norm_eps"]))
            self.norm.register_forward_pre_hook(self._collapse_streams)
        self.post_init()

    def _collapse_streams(self, _norm, args):
        return (self.hc_head(args[0]), *args[1:]) if args[0].ndim == 4 else None

    def _init_weights(self, module) -> None:
        super()._init_weights(module)
        if isinstance(module, HyperConnection):  # a non-persistent constant: rebuilt after load
            init.copy_(module._scale_index, scale_index(module.num_streams))

    def _engram_state(self, cache, batch: int, device) -> EngramCacheState:
        state = getattr(cache, "engram_state", None) if cache is not None else None
        if state is not None and cache.get_seq_length() > 0:
            if state.history.shape[0] != batch:
                raise InputError(f"the cache holds {state.history.shape[0]} sequences, the input "
                                 f"{batch}: Engram's decoding state cannot be reordered")
            return state
        hasher = self.engram_hash.hasher()
        conv = {}
        for layer in self.engram_hash.layer_ids:
            module = self.layers[layer].engram
            channels = module.hidden_size * module.hc_mult
            conv[layer] = torch.zeros(batch, channels, module.short_conv.left_pad, device=device)
        return EngramCacheState(hasher.new_history(batch), conv)

    def _hash(self, state: EngramCacheState, ids: np.ndarray, keep: torch.Tensor | None):
        """Hashes [L, B, T, K] of `ids`; a row's padding positions are left out of its n-gram
        history (their hashes are zero and never used)."""
        hasher = self.engram_hash.hasher()
        if keep is None:
            return hasher.extend(state.history, ids)
        kept = keep.cpu().numpy()
        out = np.zeros((len(self.engram_hash.layer_ids), *ids.shape, hasher.num_heads), np.int64)
        for row in range(ids.shape[0]):
            cols = np.flatnonzero(kept[row])
            out[:, row, cols] = hasher.extend(state.history[row: row + 1], ids[row: row + 1, cols])[:, 0]
        return out

    def _document_distance(self, state: EngramCacheState, ids: np.ndarray,
                           keep: torch.Tensor | None) -> torch.Tensor | None:
        """Document distances [T, B] of `ids` (``engram_reset_at_eos``; None without it),
        continuing each row's ``state.since_start``; a row's padding positions are left out (their
        distance is 0: the conv output there is never used, and their values are zero)."""
        eos_id = self.engram_hash.hasher().eos_id
        if eos_id is None:
            return None
        if state.since_start is None:
            state.since_start = np.zeros(ids.shape[0], np.int64)
        if keep is None:
            found, state.since_start = continue_document_distance(ids, eos_id, state.since_start)
        else:
            kept = keep.cpu().numpy()
            found = np.zeros(ids.shape, np.int64)
            for row in range(ids.shape[0]):
                cols = np.flatnonzero(kept[row])
                part, since = continue_document_distance(
                    ids[row: row + 1, cols], eos_id, state.since_start[row: row + 1])
                found[row, cols] = part[0]
                state.since_start[row] = since[0]
        return torch.from_numpy(np.ascontiguousarray(found.T))

    def forward(self, input_ids=None, *args, inputs_embeds=None, use_cache=None, **kwargs):
        if self.engram_hash is None:  # mHC alone
            return super().forward(input_ids, *args, inputs_embeds=inputs_embeds,
                                   use_cache=use_cache, **kwargs)
        if input_ids is None:
            raise InputError("Engram hashes token ids: call the model with input_ids (not "
                             "inputs_embeds)")
        cache = kwargs.pop("cache", None) or kwargs.pop("past_key_values", None)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        state = self._engram_state(cache, input_ids.shape[0], input_ids.device)
        keep = _kept_positions(kwargs.get("attention_mask"), input_ids.shape[1])
        ids = input_ids.cpu().numpy()
        hashes = self._hash(state, ids, keep)
        distance = self._document_distance(state, ids, keep)
        for index, layer in enumerate(self.engram_hash.layer_ids):
            block = torch.from_numpy(np.ascontiguousarray(hashes[index].transpose(1, 0, 2)))
            # [T, B, K] sequence first; kept positions [B, T] and document distances [T, B]
            self.layers[layer].engram_step = (block, state, keep, distance)
        try:
            output = super().forward(input_ids, *args, cache=cache, use_cache=use_cache, **kwargs)
        finally:
            for layer in self.engram_hash.layer_ids:
                self.layers[layer].engram_step = None
        state.tokens += input_ids.shape[1]
        if cache is not None:
            cache.engram_state = state
        return output


def _kept_positions(attention_mask, length: int) -> torch.Tensor | None:
    """The token positions [B, length] of this call's ids in a 2-D ``attention_mask`` (its last
    `length` columns), None when every position is a token. Right padding (a row's pad after
    one of its tokens) is refused: decoding would continue from the pads."""
    if attention_mask is None or attention_mask.ndim != 2:
        return None
    mask = attention_mask.bool()
    started = mask.long().cumsum(-1) > 0
    if bool((started & ~mask).any()):
        raise InputError("attention_mask pads a row after its tokens (right padding): Engram "
                         "skips padding only before a row's tokens; pad on the left "
                         "(tokenizer.padding_side = 'left')")
    keep = mask[:, -length:]
    return None if bool(keep.all()) else keep


class EngramDeepseekV3ForCausalLM(DeepseekV3ForCausalLM):
    """``DeepseekV3ForCausalLM`` on `EngramDeepseekV3Model`; generate() works with the cache."""

    config_class = EngramDeepseekV3Config

    def __init__(self, config: EngramDeepseekV3Config) -> None:
        super().__init__(config)
        self.model = EngramDeepseekV3Model(config)
        self.post_init()

    def generate(self, *args, **kwargs):
        """transformers' generate; beam search is refused: it reorders the KV cache between
        steps, and the Engram state (n-gram history, conv context) would not follow."""
        config = kwargs.get("generation_config") or self.generation_config
        beams = kwargs.get("num_beams", config.num_beams) or 1
        if beams > 1:
            raise InputError(f"num_beams={beams}: beam search is not supported with Engram (its "
                             "decoding state is not reordered with the cache); use num_beams=1")
        return super().generate(*args, **kwargs)


def _register() -> None:
    """Auto classes, and DeepSeek-V3's checkpoint conversion (per-expert files -> fused expert
    parameters) for this model type."""
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    AutoConfig.register(MODEL_TYPE, EngramDeepseekV3Config, exist_ok=True)
    AutoModelForCausalLM.register(EngramDeepseekV3Config, EngramDeepseekV3ForCausalLM,
                                  exist_ok=True)
    if get_checkpoint_conversion_mapping(MODEL_TYPE) is None:
        register_checkpoint_conversion_mapping(
            MODEL_TYPE, get_checkpoint_conversion_mapping("deepseek_v3"))


_register()
