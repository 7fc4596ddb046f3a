"""The CPU compatibility layer: active without CUDA, inert when CUDA is reported present."""

import math
import sys

import pytest
import torch
from launch import run_process

CHECK_GUARD = """
import torch
torch.cuda.is_available = lambda: True      # what a GPU host reports
original = torch.cuda.current_device
from engram_train.runtime import install_cpu_compat, is_installed
assert install_cpu_compat() is False
assert not is_installed()
assert torch.cuda.current_device is original
assert torch.zeros.__module__ != 'engram_train.runtime.cpu_compat'
print('GUARD-OK')
"""

CHECK_INSTALL = """
import torch
from engram_train.runtime import install_cpu_compat, uninstall_cpu_compat, is_installed
original_zeros, original_type = torch.zeros, torch.Tensor.type
assert install_cpu_compat() is True and is_installed()
assert torch.cuda.current_device() == 'cpu'
assert torch.zeros(2, device='cuda').device.type == 'cpu'
assert torch.zeros(2).type() == 'torch.cuda.FloatTensor'
assert torch.zeros(2).type(torch.float64).dtype == torch.float64
torch.cuda.manual_seed(3); a = torch.rand(3); torch.manual_seed(3); b = torch.rand(3)
assert torch.equal(a, b)
uninstall_cpu_compat()
assert not is_installed() and torch.zeros is original_zeros and torch.Tensor.type is original_type
print('INSTALL-OK')
"""


def _run(code: str) -> str:
    proc = run_process([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_cpu_layer_not_installed_when_cuda_available():
    assert "GUARD-OK" in _run(CHECK_GUARD)


def test_cpu_layer_installs_and_uninstalls_without_cuda():
    assert not torch.cuda.is_available()
    assert "INSTALL-OK" in _run(CHECK_INSTALL)


def test_parallel_sizes_errors_name_the_sizes():
    from engram_train.runtime import ParallelSizes

    with pytest.raises(ValueError, match=r"world size 4 is not divisible .* tensor \(3\)"):
        ParallelSizes(tensor=3).validate(4)
    with pytest.raises(ValueError, match="expert_model_parallel_size 4"):
        ParallelSizes(tensor=2, expert=4).validate(4)
    ParallelSizes(tensor=2, pipeline=2).validate(4)


def test_sdpa_core_attention_matches_explicit_softmax_with_mla_head_dims():
    """MLA: q/k head dim 24, v head dim 16, causal; compare with an explicit computation."""
    from megatron.core.transformer.enums import AttnMaskType

    from engram_train.models.deepseek_v3.v3_config import deepseek_v3_config
    from engram_train.models.presets import backbone_preset
    from engram_train.models.local_modules import SDPACoreAttention

    config = deepseek_v3_config(**backbone_preset("deepseek_v3_tiny"))
    attn = SDPACoreAttention(config, 1, AttnMaskType.causal, "self", k_channels=24, v_channels=16)
    s, b, h = 7, 2, 4
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(s, b, h, 24, generator=g), torch.randn(s, b, h, 24, generator=g)
    v = torch.randn(s, b, h, 16, generator=g)
    out = attn(q, k, v, None)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(24)
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
    ref = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(s, b, h * 16)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_local_spec_swaps_only_the_cpu_incapable_modules():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from engram_train.models.deepseek_v3.v3_config import deepseek_v3_config
    from engram_train.models.presets import backbone_preset
    from engram_train.models.local_modules import RMSNorm, SDPACoreAttention
    from engram_train.models.deepseek_v3.v3_specs import deepseek_v3_block_spec

    config = deepseek_v3_config(**backbone_preset("deepseek_v3_tiny"))
    spec = deepseek_v3_block_spec(config, use_te=False, pp_rank=0)
    text = repr(spec)
    assert "DotProductAttention'" not in text.replace("SDPACoreAttention", "")
    assert WrappedTorchNorm.__name__ not in text
    assert SDPACoreAttention.__name__ in text and RMSNorm.__name__ in text
    # first_k_dense_replace=1: layer 0 dense MLP, the others MoE.
    assert "MoELayer" not in repr(spec.layer_specs[0]) and "MoELayer" in repr(spec.layer_specs[1])
    assert spec.layer_norm is RMSNorm
    assert DotProductAttention is not SDPACoreAttention
