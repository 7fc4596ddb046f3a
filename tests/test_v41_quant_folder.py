"""A DeepSeek-V4.1 folder in the release's quantized layout, in and out (docs/deepseek-v41.md
'The released quantized layout').

NeMo Automodel 0.7.0's V4.1 on the tiny preset's fields (tests/v41_reference.py), weights
initialised and moved away from their init, is written under the released names by NeMo's
state-dict adapter (``to_hf``) and ``save_pretrained``, its weights quantized by the project's
encoder (NeMo has no weight quantizer; ``tests/test_v41_quant.py`` holds the encoder's rounding
to NeMo's ``quantize_cache``). NeMo's own loading path (``from_hf``, which dequantizes) reads
the folder to the values the project's decoder gives. Then ``engram-import-hf`` at one process
and ``engram-export --format hf`` of the import: every quantized tensor's dequantized values
back exactly (by default in the released layout, with ``--hf-layout bf16`` unquantized: bf16
holds them exactly), every other tensor within 1e-6.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import v41_reference as ref
from engram_train.models.deepseek_v41.hf import v41_quant as q
from engram_train.models.deepseek_v41.hf.v41_quant_layout import (
    RELEASE_QUANTIZATION_CONFIG,
    dequantize_from_release,
    stored_format,
)
from launch import REPO, free_port, run_process
from v41_folders import (folder_tensors, move_weights, nemo_model, release_values, v41_config,
                         write_folder)

TOLERANCE = 1e-6


def nemo_quantized_folder(folder) -> dict[str, torch.Tensor]:
    """NeMo's tiny V4.1 (float32) written to `folder` in the quantized layout (inside
    ``side()``); returns NeMo's ``from_hf`` of the quantized and of the decoded tensors."""
    from test_deepseek_v41_model import tiny_config, tiny_model_section

    from engram_train.engram.variant import v41_engram_args
    from engram_train.models.deepseek_v41.v41_config import V41_FIELDS

    ours = tiny_config(engram=True)
    text = {k: v for k, v in tiny_model_section().items() if k in V41_FIELDS}
    text["hidden_size"] = ours.hidden_size
    config = v41_config(text, v41_engram_args(ours))
    model = nemo_model(config, 0)
    move_weights(model, 5, hc=False, gates=False)
    stored = write_folder(model, config, folder, quantized=True)
    decoded = {n: dequantize_from_release(n, v, stored.get(q.scale_name(n)))
               if stored_format(n) in q.QUANTIZED_FORMATS else v
               for n, v in stored.items() if stored_format(n) != "e8m0"}
    adapter = model.state_dict_adapter
    return {"from_quantized": adapter.from_hf(dict(stored)),
            "from_decoded": adapter.from_hf(dict(decoded))}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    import torch.distributed as dist

    assert not dist.is_initialized()  # NeMo's Engram tables take a process group's world
    root = tmp_path_factory.mktemp("v41_quant")
    with ref.side():
        nemo = nemo_quantized_folder(root / "source")
    return {"root": root, "folder": root / "source", "nemo": nemo}


def test_nemo_reads_the_quantized_folder_as_our_decoder(source):
    quantized, decoded = source["nemo"]["from_quantized"], source["nemo"]["from_decoded"]
    assert sorted(quantized) == sorted(decoded)
    for name, value in quantized.items():
        assert value.dtype == decoded[name].dtype and torch.equal(value, decoded[name]), name


def test_import_and_export_give_back_every_value(source, tmp_path, monkeypatch):
    from engram_train.export import hf_released
    from engram_train.export.export_cli import main

    checkpoint = source["root"] / "import"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
           f"--master-port={free_port()}", "-m", "engram_train.hf.importer",
           "--hf", str(source["folder"]), "--out", str(checkpoint), "--seq-length", "64"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = run_process(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    src = folder_tensors(source["folder"])
    want = release_values(src)
    # row blocks of 2048 values (64 rows of the tiny model's 32-wide tables, ...): most
    # tensors written in several blocks, the Engram tables' last one partial
    monkeypatch.setattr(hf_released, "ROW_BLOCK_ELEMENTS", 2048)
    main(["--format", "hf", "--load", str(checkpoint), "--out", str(tmp_path / "released")])
    monkeypatch.undo()
    exported = folder_tensors(tmp_path / "released")
    assert sorted(exported) == sorted(src)
    doc = json.loads((tmp_path / "released" / "config.json").read_text())
    assert doc["quantization_config"] == RELEASE_QUANTIZATION_CONFIG
    main(["--format", "hf", "--load", str(checkpoint), "--out", str(tmp_path / "bf16"),
          "--hf-layout", "bf16"])
    unquantized = folder_tensors(tmp_path / "bf16")
    assert sorted(unquantized) == sorted(want)
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    for got in (exported, unquantized):
        got_values = release_values(got)
        for name, value in want.items():
            fmt = stored_format(name)
            assert got[name].dtype == (src[name].dtype if got is exported or fmt in (
                "float32", "bf16") else torch.bfloat16), name
            if fmt in q.QUANTIZED_FORMATS:
                assert torch.equal(got_values[name], value), name
            else:
                assert (got_values[name] - value).abs().max() <= TOLERANCE, name
    with pytest.raises(SystemExit, match="--hf-layout does not apply to --format engram"):
        main(["--load", str(checkpoint), "--out", str(tmp_path / "engram"), "--hf-layout", "bf16"])
    kinds = {stored_format(n) for n in want}
    assert kinds >= {"fp8_block", "fp4_rows", "fp8_rows", "float32", "bf16"}
