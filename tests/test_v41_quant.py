"""DeepSeek-V4.1's released quantized layout (``models/deepseek_v41/hf/v41_quant.py``,
``v41_quant_layout.py``).

The decoders against NeMo Automodel 0.7.0's ``dequantize_checkpoint_weight`` (the reference
decoder of the released folder) bit for bit on random stored tensors of each format; a slice
decodes as the same slice of the whole (from tensors and from safetensors ``get_slice``); the
encoder's rounding equals NeMo's reference quantizer (``quantize_cache``, the release's
per-32-column FP8 and MXFP4 rules) on random values; ``encode(decode(x))`` gives x's values bit
for bit and x's bytes where a block keeps its scale; the name table agrees with the dtypes of
NeMo's quantized ``to_hf`` targets; damaged input is refused in one line naming the tensor.
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import v41_reference as ref
from engram_train.errors import EngramError
from engram_train.models.deepseek_v41.hf import v41_quant as q
from engram_train.models.hf_folder import HFSourceError
from engram_train.models.deepseek_v41.hf.v41_quant_layout import (
    dequantize_from_release,
    quantize_for_release,
    release_shape,
    release_weight_names,
    stored_format,
)

# (format, logical shape): ragged edges on purpose (partial 32-row and 32-column blocks)
CASES = [("fp8_block", (70, 100)), ("fp8_rows", (9, 96)), ("fp4_rows", (7, 90))]
NAMES = {"fp8_block": "layers.0.attn.wq_a.weight", "fp8_rows": "layers.1.engram.embed.weight",
         "fp4_rows": "layers.0.ffn.experts.3.w2.weight"}


def random_stored(fmt: str, shape: tuple[int, int], seed: int = 0, exponents=(-40, 40)):
    """Random codes (FP8 without its NaN codes 0x7F/0xFF; every FP4 byte) and E8M0 scales
    2^e, e in `exponents`."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = shape
    if fmt == "fp4_rows":
        weight = torch.randint(-128, 128, (rows, cols // 2), generator=g, dtype=torch.int8)
    else:
        raw = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        raw[(raw & 0x7F) == 0x7F] = 0x3C
        weight = raw.view(torch.float8_e4m3fn)
    low, high = exponents
    scale = torch.randint(127 + low, 127 + high + 1, q.scale_shape(fmt, shape), generator=g,
                          dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return weight, scale


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.fixture(scope="module")
def nemo_decoded():
    """NeMo's decoding of each case, in float32 and bf16."""
    out = {}
    with ref.side():
        from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import (
            dequantize_checkpoint_weight,
        )

        for fmt, shape in CASES:
            weight, scale = random_stored(fmt, shape)
            for dtype in (torch.float32, torch.bfloat16):
                out[fmt, dtype] = dequantize_checkpoint_weight(
                    weight, scale, dtype=dtype, rowwise=fmt == "fp8_rows")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,shape", CASES)
def test_decoders_match_nemo_bit_for_bit(nemo_decoded, fmt, shape, dtype):
    weight, scale = random_stored(fmt, shape)
    ours = q.decode(fmt, weight, scale, name=NAMES[fmt], dtype=dtype, chunk_elements=300)
    assert ours.shape == shape
    assert torch.equal(bits(ours), bits(nemo_decoded[fmt, dtype]))


@pytest.mark.parametrize("fmt,shape", CASES)
def test_a_slice_decodes_as_the_slice_of_the_whole(tmp_path, fmt, shape):
    weight, scale = random_stored(fmt, shape, seed=1)
    whole = q.decode(fmt, weight, scale, name="w")
    save_file({"w": weight, "s": scale}, str(tmp_path / "f.safetensors"))
    g = torch.Generator().manual_seed(2)
    with safe_open(str(tmp_path / "f.safetensors"), "pt") as f:
        stored_w, stored_s = f.get_slice("w"), f.get_slice("s")
        spans = [((0, shape[0]), (0, shape[1])), ((33, 34), (31, 33)), ((3, 3), (0, 5))]
        for _ in range(12):
            r = sorted(torch.randint(0, shape[0] + 1, (2,), generator=g).tolist())
            c = sorted(torch.randint(0, shape[1] + 1, (2,), generator=g).tolist())
            spans.append((tuple(r), tuple(c)))
        for rows, cols in spans:
            rows = (min(rows[0], shape[0]), min(rows[1], shape[0]))
            want = whole[rows[0]:rows[1], cols[0]:cols[1]]
            for w, s in ((weight, scale), (stored_w, stored_s)):
                got = q.decode(fmt, w, s, name="w", rows=rows, cols=cols, chunk_elements=64)
                assert torch.equal(bits(got), bits(want)), (fmt, rows, cols)


class Recorded:
    """A safetensors-slice-like view of a tensor that records the boxes read."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.boxes = tensor, []

    def get_shape(self):
        return list(self.tensor.shape)

    def get_dtype(self):
        return {torch.float8_e4m3fn: "F8_E4M3", torch.int8: "I8",
                torch.float8_e8m0fnu: "F8_E8M0"}[self.tensor.dtype]

    def __getitem__(self, box):
        self.boxes.append(tuple((b.start, b.stop) for b in box))
        return self.tensor[box]


@pytest.mark.parametrize("fmt,shape", CASES)
def test_a_slice_reads_only_its_blocks(fmt, shape):
    weight, scale = random_stored(fmt, shape, seed=3)
    w, s = Recorded(weight), Recorded(scale)
    rows, cols = (5, 7), (33, 41)
    got = q.decode(fmt, w, s, name="w", rows=rows, cols=cols)
    assert torch.equal(bits(got), bits(q.decode(fmt, weight, scale, name="w")[5:7, 33:41]))
    rb = q.row_block(fmt)
    packed = 2 if fmt == "fp4_rows" else 1
    assert w.boxes == [((rows[0] // rb * rb, min(-(-rows[1] // rb) * rb, shape[0])),
                        (32 // packed, 64 // packed))]
    assert s.boxes == [((rows[0] // rb, -(-rows[1] // rb)), (1, 2))]


@pytest.mark.parametrize("fmt", ["fp8_rows", "fp4_rows"])
def test_encoder_rounds_as_the_releases_quantizer(fmt):
    values = torch.randn(16, 128, generator=torch.Generator().manual_seed(3)) * 3
    values[2, :32] = 0.0  # an all-zero block
    values[3] = values[3] * 1e-3
    with ref.side():
        from nemo_automodel.components.models.deepseek_v41.quantization import quantize_cache

        want = quantize_cache(values, format="fp8" if fmt == "fp8_rows" else "mxfp4",
                              block_size=32)
    if fmt == "fp4_rows":  # its negative values rounding to 0 give -0; stored E2M1 decodes +0
        want = want + 0.0
    weight, scale = q.encode(fmt, values, name="w", chunk_elements=200)
    assert torch.equal(bits(q.decode(fmt, weight, scale, name="w")), bits(want))
    again = q.encode(fmt, want, name="w")  # values again (a block whose codes round to at
    assert torch.equal(bits(q.decode(fmt, *again, name="w")), bits(want))  # most 448/2: halved)


def grid_and_ties(fmt: str) -> torch.Tensor:
    """Rows of 32 with amax 6 (FP4) resp. 448 (FP8), scale 1: every grid point, every midpoint
    between neighbours (a tie) and the floats either side of it, with both signs."""
    if fmt == "fp4_rows":
        grid = torch.tensor(q.FP4_LEVELS)
    else:
        grid = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    ties = (grid[1:] + grid[:-1]) / 2
    points = torch.cat([grid, ties, ties.nextafter(torch.tensor(0.0)),
                        ties.nextafter(torch.tensor(1e9))])
    points = torch.cat([points, -points])
    rest = torch.zeros(-(-points.numel() // 31) * 31)
    rest[:points.numel()] = points
    rest = rest.view(-1, 31)
    return torch.cat([torch.full((rest.shape[0], 1), grid.max().item()), rest], dim=1)


@pytest.mark.parametrize("fmt", ["fp8_rows", "fp4_rows"])
def test_ties_round_to_even_as_the_releases_quantizer(fmt):
    values = grid_and_ties(fmt)
    with ref.side():
        from nemo_automodel.components.models.deepseek_v41.quantization import quantize_cache

        want = quantize_cache(values, format="fp8" if fmt == "fp8_rows" else "mxfp4",
                              block_size=32) + 0.0  # -0 as +0: values compared
    weight, scale = q.encode(fmt, values, name="w")
    assert (scale.view(torch.uint8) == 127).all()
    assert torch.equal(bits(q.decode(fmt, weight, scale, name="w") + 0.0), bits(want))


def edge_cases(fmt: str, shape: tuple[int, int]):
    """Random stored tensors with edge blocks: all-zero codes, the largest codes, subnormal
    FP8 codes only, exactly half the largest code, the smallest and large scales."""
    weight, scale = random_stored(fmt, shape, seed=4, exponents=(-127, 100))
    raw = weight.view(torch.uint8)
    rb, fp4 = q.row_block(fmt), fmt == "fp4_rows"
    # codes 0 | 448 / 6 (6, 6) | 5 * 2^-9 (subnormal) / 0.5 (0.5, 0.5) | 224 / 3 (3, 3)
    fills = {0: 0x00, 1: 0x77 if fp4 else 0x7E, 2: 0x11 if fp4 else 0x05, 3: 0x55 if fp4 else 0x76}
    for block, byte in fills.items():  # the first 32 columns of row blocks 0..3
        raw[block * rb: (block + 1) * rb, :16 if fp4 else 32] = byte
    scale.view(torch.uint8)[4, 0] = 0  # 2^-127
    return weight, scale


@pytest.mark.parametrize("fmt,shape", [("fp8_block", (160, 64)), ("fp8_rows", (8, 64)),
                                       ("fp4_rows", (8, 64))])
def test_encode_of_decode_gives_the_values_and_the_bytes_where_the_scale_stays(fmt, shape):
    for edges, (weight, scale) in enumerate((random_stored(fmt, shape, seed=5,
                                                           exponents=(-127, 100)),
                                             edge_cases(fmt, shape))):
        values = q.decode(fmt, weight, scale, name="w")
        assert torch.isfinite(values).all()
        again_w, again_s = q.encode(fmt, values, name="w", chunk_elements=100)
        assert torch.equal(bits(q.decode(fmt, again_w, again_s, name="w")), bits(values))
        rb = q.row_block(fmt)
        codes = q.decode(fmt, weight, torch.full_like(scale.view(torch.uint8), 127).view(
            scale.dtype), name="w").abs()
        top = torch.nn.functional.pad(codes, (0, -shape[1] % 32, 0, -shape[0] % rb)).unflatten(
            1, (-1, 32)).unflatten(0, (-1, rb)).amax(dim=(1, 3))
        keeps = top > (q.FP4_MAX if fmt == "fp4_rows" else q.FP8_MAX) / 2
        assert keeps.any() and (bool((~keeps).any()) or not edges)
        assert torch.equal(again_s.view(torch.uint8)[keeps], scale.view(torch.uint8)[keeps])
        stored, restored = weight.view(torch.uint8), again_w.view(torch.uint8)
        if fmt == "fp4_rows":  # code 8 (-0) re-encodes as code 0
            stored = torch.stack([stored & 15, stored >> 4], -1).flatten(1)
            restored = torch.stack([restored & 15, restored >> 4], -1).flatten(1)
            stored = torch.where(stored == 8, 0, stored)
        per_value = keeps.repeat_interleave(rb, 0)[:shape[0]].repeat_interleave(32, 1)
        assert torch.equal(restored[per_value], stored[per_value])
        if not edges:
            continue
        zero_block = (top == 0).nonzero()[0].tolist()
        zero_code = 127 + (q.FP4_ZERO_BLOCK_EXPONENT if fmt == "fp4_rows"
                           else q.FP8_ZERO_BLOCK_EXPONENT)
        assert again_s.view(torch.uint8)[tuple(zero_block)] == zero_code


def test_the_name_table_agrees_with_nemos_quantized_targets():
    """Every released name of NeMo's tiny V4.1 (bf16, Engram on) in the format NeMo's
    quantized load targets give it, and our encoder's shapes equal NeMo's targets'."""
    from test_deepseek_v41_blocks import nemo_backend
    from test_deepseek_v41_model import tiny_config, tiny_model_section

    from engram_train.engram.variant import v41_engram_args
    from engram_train.models.deepseek_v41.v41_config import V41_FIELDS

    ours = tiny_config(engram=True)
    backbone = {k: v for k, v in tiny_model_section().items()
                if k in V41_FIELDS and k != "hidden_size"}
    with ref.side():
        from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
        from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

        text = ref.text_config(v41_engram_args(ours), ours.hidden_size, **backbone).to_dict()
        text["dtype"] = "bfloat16"
        config = DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0})
        with torch.device("meta"):
            model = DeepseekV41ForCausalLM(config, backend=nemo_backend(),
                                           tokenizer=ref.tokenizer())
        plain = model.state_dict_adapter.to_hf(model.state_dict())
        targets = model.state_dict_adapter.to_hf(model.state_dict(), quantization=True,
                                                 for_checkpoint_load=True)
    kind = {torch.int8: "fp4_rows", torch.float8_e8m0fnu: "e8m0", torch.float32: "float32",
            torch.bfloat16: "bf16"}
    seen = set()
    for name, target in targets.items():
        want = kind.get(target.dtype)
        if target.dtype == torch.float8_e4m3fn:
            rows = targets[q.scale_name(name)].shape[0] == target.shape[0]
            want = "fp8_rows" if rows and ".engram.embed." in name else "fp8_block"
        assert stored_format(name) == want, name
        seen.add(want)
        if want in q.QUANTIZED_FORMATS:
            values = torch.zeros(plain[name].shape)
            pairs = dict(quantize_for_release(name, values))
            assert pairs[name].shape == target.shape and pairs[name].dtype == target.dtype
            scale = targets[q.scale_name(name)]
            assert pairs[q.scale_name(name)].shape == scale.shape, name
            assert release_shape(name, pairs[name]) == tuple(plain[name].shape)
    assert seen == {"fp8_block", "fp4_rows", "fp8_rows", "e8m0", "float32", "bf16"}


def test_quantize_for_release_and_back():
    g = torch.Generator().manual_seed(6)
    model = {"layers.0.attn.wq_b.weight": torch.randn(64, 40, generator=g),
             "layers.0.ffn.experts.1.w1.weight": torch.randn(32, 64, generator=g),
             "layers.1.engram.embed.weight": torch.randn(50, 64, generator=g),
             "layers.0.hc_attn_fn": torch.randn(24, 256, generator=g),
             "layers.0.attn_norm.weight": torch.randn(64, generator=g)}
    for quantized in (True, False):
        folder = dict(p for name, value in model.items()
                      for p in quantize_for_release(name, value, quantized=quantized))
        assert (len(folder) == 8) == quantized
        assert folder["layers.0.hc_attn_fn"].dtype == torch.float32
        assert folder["layers.0.attn_norm.weight"].dtype == torch.bfloat16
        names = release_weight_names(list(folder))
        assert names == list(model)
        for name in names:
            scale = folder.get(q.scale_name(name))
            whole = dequantize_from_release(name, folder[name], scale)
            if stored_format(name) in q.QUANTIZED_FORMATS and quantized:
                fmt = stored_format(name)
                assert torch.equal(whole, q.decode(fmt, folder[name], scale, name=name))
                # FP4's coarsest step: 2 of a block's 6
                assert (whole - model[name]).abs().max() <= model[name].abs().max() / 4
            else:
                assert torch.equal(whole, folder[name].float())
            if whole.ndim == 2:
                part = dequantize_from_release(name, folder[name], scale, rows=(3, 9), cols=(5, 38))
                assert torch.equal(part, whole[3:9, 5:38])


def refused(call, *words, cls=q.V41QuantSourceError):
    with pytest.raises(cls) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message
    assert isinstance(info.value, EngramError)
    return info.value


def test_damaged_input_is_refused_naming_the_tensor():
    name = "layers.0.attn.wo_b.weight"
    weight, scale = random_stored("fp8_block", (64, 64))
    err = refused(lambda: dequantize_from_release(name, weight), name, "wo_b.scale")
    assert isinstance(err, HFSourceError)
    refused(lambda: dequantize_from_release(name, weight, scale[:1]), "wo_b.scale", "(1, 2)",
            "(2, 2)")
    refused(lambda: dequantize_from_release(name, weight, scale.float()), "wo_b.scale",
            "torch.float32")
    bad = scale.clone()
    bad.view(torch.uint8)[1, 1] = 255
    refused(lambda: dequantize_from_release(name, weight, bad), "wo_b.scale", "NaN")
    refused(lambda: dequantize_from_release(name, weight.view(torch.float8_e5m2), scale), name,
            "float8_e5m2")
    refused(lambda: dequantize_from_release(name, torch.zeros(4, 4, dtype=torch.int32)), name,
            "int32")
    refused(lambda: dequantize_from_release(name, weight.view(torch.int8), scale), name,
            "torch.int8", "fp8_block")
    refused(lambda: dequantize_from_release("layers.0.attn_norm.weight",
                                            weight.view(torch.int8)), "attn_norm", "bf16")
    refused(lambda: dequantize_from_release("layers.0.attn_norm.weight", torch.ones(4),
                                            scale), "attn_norm.scale")
    refused(lambda: release_weight_names(["layers.0.ffn.experts.0.w2.scale"]),
            "layers.0.ffn.experts.0.w2.scale")
    expert = "layers.0.ffn.experts.0.w2.weight"
    values = torch.ones(4, 64)
    values[2, 7] = float("nan")
    refused(lambda: quantize_for_release(expert, values), expert, "[2, 7]", cls=q.V41QuantError)
    refused(lambda: quantize_for_release(expert, torch.ones(4, 63)), expert, "odd",
            cls=q.V41QuantError)
    refused(lambda: q.decode("fp8_block", weight, scale, name=name, rows=(0, 65)), name, "0:65",
            cls=q.V41QuantError)


def test_stored_format_of_the_released_names():
    table = {"embed.weight": "bf16", "head.weight": "float32", "norm.weight": "bf16",
             "layers.3.attn.indexer.wq_b.weight": "fp8_block",
             "layers.3.attn.indexer.wk.weight": "bf16",
             "layers.3.attn.compressor.wkv.weight": "float32",
             "layers.2.ffn.shared_experts.w3.weight": "fp8_block",
             "layers.2.ffn.experts.255.w3.weight": "fp4_rows",
             "layers.2.ffn.experts.255.w3.scale": "e8m0",
             "layers.2.ffn.gate.weight": "bf16", "layers.2.ffn.gate.bias": "float32",
             "layers.2.attn.attn_sink": "float32", "layers.2.hc_ffn_scale": "float32",
             "layers.14.engram.embed.weight": "fp8_rows",
             "layers.14.engram.wkv.weight": "fp8_block",
             "layers.14.engram.q_weight": "bf16", "mtp.0.main_proj.weight": "fp8_block",
             "mtp.0.ffn.experts.0.w1.weight": "fp4_rows", "layers.0.attn_norm.scale": "bf16"}
    assert {name: stored_format(name) for name in table} == table
    assert all(re.fullmatch(r"fp8_block|fp4_rows|fp8_rows|float32|bf16|e8m0", v)
               for v in table.values())
