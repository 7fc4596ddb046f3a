"""On a host without CUDA the patch ``cpu_eager_jit_fuser`` runs megatron's ``jit_fuser``
(``torch.compile``) functions as written: no TorchDynamo frame is compiled, the results are
the functions' own, and reverting the patch gives torch.compile back. Prints one JSON line."""

import json

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from engram_train.runtime import install_cpu_compat, is_installed, uninstall_cpu_compat


def main() -> None:
    from megatron.core import activations, jit
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu

    assert install_cpu_compat() and is_installed()
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(6, generator=torch.Generator().manual_seed(1))
    relu2 = activations.squared_relu(x)
    swiglu = bias_swiglu(x, bias)
    y = x + bias
    a, b = torch.chunk(y, 2, -1)
    out = dict(
        dynamo_disabled=torch._dynamo.config.disable,
        later_decorator_is_noop=jit.jit_fuser is jit.noop_decorator,
        frames_compiled=sum(counters["frames"].values()),
        squared_relu_exact=bool(torch.equal(relu2, torch.relu(x) ** 2)),
        bias_swiglu_exact=bool(torch.equal(swiglu, torch.nn.functional.silu(a) * b)),
    )
    uninstall_cpu_compat()
    out["reverted"] = torch._dynamo.config.disable is False and jit.jit_fuser is torch.compile
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
