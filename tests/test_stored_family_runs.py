"""Checkpoints, exports and an import written by an earlier version of the project (the one
before each model family moved into its own folder) give the same numbers and bytes today:
through the shared commands, one process each (tests/family_fixtures.py writes the fixtures
and says how).

- a DeepSeek-V3 and a DeepSeek-V4.1 checkpoint (Engram on, model and optimizer at iteration 2)
  resume for two steps with the same losses, bit for bit;
- ``engram-export --format hf`` of each writes the same files, byte for byte (V3 with Engram:
  the ``engram_deepseek_v3`` folder and its modeling code; V4.1: the released quantized layout);
- ``engram-import-hf`` of the stored transformers folder writes the same tensors and preset,
  and the stored import of it continues with the same losses; the V4.1 export imports back to
  the same tensors and preset.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import family_fixtures as fx

FIXTURES = Path(__file__).parent / "data" / "before_family_registry"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
TOKENIZER = FIXTURES / "tokenizer" / "tokenizer.json"
DATA = FIXTURES / "data" / "corpus_text_document"
MODELS = {"v3": fx.V3_MODEL, "v41": fx.V41_MODEL}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("stored_family_runs")


@pytest.mark.parametrize("name", ["v3", "v41"])
def test_stored_checkpoint_resumes_with_the_same_losses(work, name):
    out = work / f"{name}_resumed"
    out.mkdir()
    losses = fx.train(out, MODELS[name], TOKENIZER, DATA, fx.SAVED_AT + fx.RESUMED_ITERS,
                      load=FIXTURES / name)
    assert losses == EXPECTED[f"{name}_resumed_losses"]


@pytest.mark.parametrize("name", ["v3", "v41"])
def test_stored_checkpoint_exports_the_same_files(work, name):
    config = fx.placed_config(FIXTURES / f"{name}_config.yaml", FIXTURES,
                              work / f"{name}_config.yaml")
    assert fx.export(FIXTURES / name, work / f"{name}_hf", TOKENIZER, config) == \
        EXPECTED[f"{name}_export"]


def test_stored_transformers_folder_imports_the_same_and_the_stored_import_resumes(work):
    stored = {p.name for p in (FIXTURES / "v3_plain_hf").iterdir()}
    assert stored == set(EXPECTED["v3_plain_export"])
    fx.import_hf(FIXTURES / "v3_plain_hf", work / "v3_import")
    assert fx.tensor_digests(work / "v3_import") == EXPECTED["v3_import_tensors"]
    assert fx.preset_text(work / "v3_import") == EXPECTED["v3_import_preset"]
    out = work / "v3_import_resumed"
    out.mkdir()
    losses = fx.train(out, ["model=hf_import"], TOKENIZER, DATA, fx.RESUMED_ITERS,
                      load=FIXTURES / "v3_import",
                      extra=[f"--config-dir={FIXTURES / 'v3_import' / 'conf'}"])
    assert losses == EXPECTED["v3_import_resumed_losses"]


def test_v41_released_export_imports_the_same(work):
    folder = work / "v41_hf"
    if not folder.is_dir():  # this test alone
        config = fx.placed_config(FIXTURES / "v41_config.yaml", FIXTURES, work / "v41_config.yaml")
        fx.export(FIXTURES / "v41", folder, TOKENIZER, config)
    fx.import_hf(folder, work / "v41_import")
    assert fx.tensor_digests(work / "v41_import") == EXPECTED["v41_import_tensors"]
    assert fx.preset_text(work / "v41_import") == EXPECTED["v41_import_preset"]
