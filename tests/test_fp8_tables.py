"""Engram tables stored as FP8 E4M3 with E8M0 scales (``model.engram_table_dtype: fp8_e4m3``,
``engram/fp8_table.py``): the quantizer against values worked out by hand, the stochastic
rounding unbiased and keyed by global rows (the same bytes under any split of the rows), the
config refusals, and the trainer: a frozen fp8 run trains its backbone and keeps the table
bytes of the init; a trained one (rowwise_adam, host placement) saved and resumed mid-run
gives the losses of the same run without a save on device placement, and its checkpoint holds
the bf16 row second moment."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from engram_train.engram.fp8_table import (
    FP8_DTYPE,
    dequantize_rows,
    quantize_rows,
    scale_blocks,
    store_rows,
)

FP8_TRAINED = ["model.engram_table_dtype=fp8_e4m3", "model.engram_optimizer=rowwise_adam",
               "model.engram_master_weights=false", "model.engram_optimizer_state_dtype=bf16",
               "model.engram_table_placement=host"]
FP8_FROZEN = ["model.engram_table_dtype=fp8_e4m3", "+model.engram_freeze_tables=true",
              "model.engram_table_placement=host"]
SMALL = ["train.seq_length=32", "train.global_batch_size=2", "train.micro_batch_size=2",
         "train.eval_interval=null", "train.log_interval=1"]


def test_quantize_matches_hand_worked_values():
    # amax 1.0: 1/448 lies in (2^-9, 2^-8] -> scale 2^-8 (E8M0 byte 127 - 8 = 119); values x 256
    # on the E4M3 grid: 0.3 x 256 = 76.8 -> 80 (step 8 in [64, 128)); 78 is a tie between 72
    # (mantissa 001) and 80 (010): to even, 80; 0.003 x 256 = 0.768 -> 0.75 (step 2^-3 in
    # [0.5, 1)); 2^-12 x 256 = 2^-4 is below E4M3's normals (2^-6): subnormal step 2^-9, exact.
    row = torch.tensor([[1.0, 0.3, 78 / 256, 0.003, -2.0**-12, -1.0]])
    q, scale = quantize_rows(row)
    assert q.dtype == FP8_DTYPE and scale.tolist() == [[119]]
    assert q.float().tolist() == [[256.0, 80.0, 80.0, 0.75, -2.0**-4, -256.0]]
    assert dequantize_rows(q, scale, torch.float32).tolist() == [
        [1.0, 0.3125, 0.3125, 0.75 / 256, -2.0**-12, -1.0]]
    # amax exactly 448 x 2^-6 -> scale 2^-6 (byte 121), amax maps to 448; an all-zero row
    # gets byte 0 and reads back zeros; 40 columns = two blocks (32 + 8), each its own scale
    q, scale = quantize_rows(torch.tensor([[7.0, 1.0], [0.0, 0.0]]))
    assert scale.tolist() == [[121], [0]] and q.float().tolist() == [[448.0, 64.0], [0.0, 0.0]]
    wide = torch.cat([torch.full((1, 32), 1.0), torch.full((1, 8), 2.0**-20)], dim=1)
    q, scale = quantize_rows(wide)
    assert scale_blocks(40) == 2 and scale.tolist() == [[119, 127 - 28]]
    assert torch.equal(dequantize_rows(q, scale, torch.float32), wide)


def test_round_trip_error_bound_and_requantize_is_exact():
    values = torch.randn(257, 48, generator=torch.Generator().manual_seed(0)) * 0.02
    q, scale = quantize_rows(values)
    back = dequantize_rows(q, scale, torch.float32)
    # relative step of E4M3 normals 2^-3: error at most half of it (or half a subnormal step)
    exponent = scale.int().repeat_interleave(32, 1)[:, :48] - 127 - 9
    step = torch.ldexp(torch.ones(exponent.shape), exponent.float())
    bound = torch.maximum(values.abs() * 2.0**-4, step / 2)
    assert ((back - values).abs() <= bound * (1 + 1e-6)).all()
    assert torch.equal(dequantize_rows(*quantize_rows(back), torch.float32), back)
    assert torch.equal(dequantize_rows(q, scale), back.to(torch.bfloat16))  # exact in bf16


def test_stochastic_rounding_is_unbiased_to_2_pow_16():
    # 76.8 lies 0.6 of the way from 72 to 80 (with fraction a multiple of 2^-16 after scaling:
    # pick it so): every one of the 2^16 bit values once gives the value's exact mean
    fraction = 39321 / 65536
    value = (72 + 8 * fraction) / 256
    row = torch.tensor([[1.0, value]]).expand(65536, 2).contiguous()
    bits = torch.arange(65536, dtype=torch.int32).unsqueeze(1).expand(65536, 2).contiguous()
    q, scale = quantize_rows(row, bits)
    out = dequantize_rows(q, scale, torch.float64)[:, 1]
    assert set(out.tolist()) == {72 / 256, 80 / 256}
    assert math.isclose(out.mean().item(), value, rel_tol=0, abs_tol=1e-15)
    assert (out == 80 / 256).sum().item() == 39321


def _rowwise_fp8_step(row_start: int, rows: int, grads: torch.Tensor, seed: int = 3):
    from engram_train.engram.tables import MultiHeadEmbedding
    from engram_train.training.rowwise_adam import RowwiseAdam

    table = MultiHeadEmbedding([7, 11, 13], 16, layer_id=2, seed=1, row_start=row_start,
                               row_end=row_start + rows, dtype=FP8_DTYPE)
    optimizer = RowwiseAdam([{"params": [table.weight]}], lr=1e-2, state_dtype="bf16", seed=seed)
    optimizer.init_state(table.weight)
    for _ in range(2):
        local = torch.arange(rows)
        optimizer.step_rows([(local, grads[row_start:row_start + rows])])
    return (table.weight.detach().view(torch.uint8).clone(), table.weight_scale.clone(),
            optimizer.state[table.weight]["exp_avg_sq_row"].clone())


def test_trained_rows_do_not_depend_on_the_row_split():
    """The re-quantization's bits and the bf16 row moment's are keyed by global rows: two
    shards give the full table's bytes, and another seed other bytes."""
    grads = torch.randn(31, 16, generator=torch.Generator().manual_seed(1))
    whole = _rowwise_fp8_step(0, 31, grads)
    first = _rowwise_fp8_step(0, 12, grads)
    second = _rowwise_fp8_step(12, 19, grads)
    for one, a, b in zip(whole, first, second):
        assert torch.equal(one, torch.cat([a, b]))
    assert whole[2].dtype == torch.bfloat16
    other = _rowwise_fp8_step(0, 31, grads, seed=4)
    assert not torch.equal(whole[0], other[0]) and not torch.equal(whole[2], other[2])


def test_bf16_row_moment_follows_the_float32_ema():
    """An fp8 table's row second moment is bf16, stochastically rounded. With beta2 = 0.999 a
    step moves v from 1 towards mean(g^2) = 1.5 by 0.0005, under half a bf16 step at 1
    (2^-8): rounded to nearest, v never moves; rounded stochastically, its mean over rows
    follows the float32 EMA."""
    from engram_train.engram.tables import MultiHeadEmbedding
    from engram_train.training.rowwise_adam import RowwiseAdam

    rows, steps, beta2 = 1024, 200, 0.999
    table = MultiHeadEmbedding([rows], 16, layer_id=0, seed=1, dtype=FP8_DTYPE)
    optimizer = RowwiseAdam([{"params": [table.weight]}], lr=1e-3, betas=(0.9, beta2),
                            state_dtype="bf16", seed=5)
    v = optimizer.init_state(table.weight)["exp_avg_sq_row"]
    v.fill_(1.0)
    every, grad = torch.arange(rows), torch.full((rows, 16), 1.5**0.5)
    exact = nearest = torch.tensor(1.0)
    for _ in range(steps):
        optimizer.step_rows([(every, grad)])
        exact = exact * beta2 + (1 - beta2) * 1.5
        nearest = (nearest * beta2 + (1 - beta2) * 1.5).bfloat16().float()
    assert v.dtype == torch.bfloat16 and nearest.item() == 1.0  # round-to-nearest: stalled
    assert 1.09 < exact.item() < 1.095
    assert abs(v.double().mean().item() - exact.item()) < 0.005  # rows spread by ~0.02 each


def test_a_float32_row_moment_loads_into_bf16():
    """A checkpoint saved when fp8 tables kept a float32 row moment resumes: the moment is
    converted (rounded to nearest bf16)."""
    from engram_train.engram.tables import MultiHeadEmbedding
    from engram_train.training.rowwise_adam import RowwiseAdam

    table = MultiHeadEmbedding([5], 16, layer_id=0, seed=1, dtype=FP8_DTYPE)
    optimizer = RowwiseAdam([{"params": [table.weight]}], lr=1e-3, state_dtype="bf16")
    optimizer.init_state(table.weight)
    saved = optimizer.state_dict()
    old = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])
    saved["state"][0] = dict(saved["state"][0], exp_avg_sq_row=old.view(-1, 1))
    optimizer.load_state_dict(saved)
    assert torch.equal(optimizer.state[table.weight]["exp_avg_sq_row"], old.bfloat16())


def test_store_rows_writes_only_the_named_rows():
    weight = torch.nn.Parameter(torch.zeros(5, 4, dtype=FP8_DTYPE))
    weight.engram_scale = torch.zeros(5, 1, dtype=torch.uint8)
    store_rows(weight, torch.tensor([3]), torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    assert weight.engram_scale.flatten().tolist() == [0, 0, 0, 121, 0]  # amax 4: scale 2^-6
    assert dequantize_rows(weight.detach(), weight.engram_scale, torch.float32)[3].tolist() == [
        1.0, 2.0, 3.0, 4.0]
    assert weight.detach().view(torch.uint8)[[0, 1, 2, 4]].eq(0).all()


def _config(**fields):
    from engram_train.config import EngramConfig

    base = dict(use_engram=True, engram_tokenizer_name_or_path="examples/data/tokenizer",
                engram_vocab_size=[101, 103], max_ngram_size=3, n_embed_per_ngram=64,
                n_head_per_ngram=4, engram_layer_ids=[1], engram_table_dtype="fp8_e4m3")
    return EngramConfig(**{**base, **fields})


@pytest.mark.parametrize("fields, words", [
    (dict(engram_optimizer="sparse_adam"), "engram_optimizer=rowwise_adam"),
    (dict(engram_optimizer="adam", engram_master_weights=False), "engram_freeze_tables=true"),
    (dict(engram_optimizer="rowwise_adam"), "engram_master_weights=false"),
    (dict(engram_freeze_tables=True, engram_offload_embedding_optimizer_states=True),
     "engram_table_placement=host"),
])
def test_config_refusals(fields, words):
    from engram_train.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        _config(**fields)
    message = str(refused.value)
    assert words in message and "engram_table_dtype=fp8_e4m3" in message and "\n" not in message


def test_config_accepts_and_counts_bytes():
    from engram_train.training.run_config import engram_table_bytes_per_param

    frozen = _config(engram_freeze_tables=True)
    trained = _config(engram_optimizer="rowwise_adam", engram_master_weights=False,
                      engram_optimizer_state_dtype="bf16")
    assert engram_table_bytes_per_param(frozen) == 1 + 1 / 16  # D = 16: one scale per row
    assert engram_table_bytes_per_param(trained) == 1 + 1 / 16 + 2 + 2 / 16  # bf16 row moment


def test_memory_plan_counts_fp8_tables(one_rank):
    """engram-plan: 1 byte and a scale byte per row of 16; frozen: nothing else; trained: the
    bf16 first moment and one bf16 second moment per row, no master."""
    from test_memory_plan import item, plan_of

    elements = item(plan_of([]).ranks[0], "engram_tables_fp32") // 4
    frozen = plan_of(FP8_FROZEN).ranks[0]
    assert item(frozen, "engram_tables_fp8_e4m3") == elements + elements // 16
    assert item(frozen, "engram_table_moments") == item(frozen, "engram_table_master") == 0
    trained = plan_of(FP8_TRAINED).ranks[0]
    per_element = sum(b for n, _, _, b in trained.items
                      if n.startswith("engram_table") and n != "engram_table_step") / elements
    assert per_element == pytest.approx(1 + 1 / 16 + 2 + 2 / 16, abs=1e-6)
    assert item(trained, "engram_table_master") == 0


def test_resume_with_another_storage_is_refused_in_one_line():
    from engram_train.training.run_identity import _storage_change, table_storage

    def storage(**fields):
        base = dict(engram_table_dtype="fp8_e4m3", engram_master_weights=False,
                    engram_freeze_tables=False)
        return table_storage(SimpleNamespace(**{**base, **fields}))

    fp8 = storage()
    assert _storage_change(fp8, storage()) is None
    to_bf16 = _storage_change(fp8, storage(engram_table_dtype="bf16"))
    assert "model.engram_table_dtype=fp8_e4m3" in to_bf16 and "\n" not in to_bf16
    to_frozen = _storage_change(fp8, storage(engram_freeze_tables=True))
    assert "model.engram_freeze_tables=false" in to_frozen and "\n" not in to_frozen


# -- the trainer (1 process each; 4 runs in all, 13 iterations) ----------------------------


def _train(tmp_path, name, *overrides):
    from launch import REPO, run_process
    from test_reliability_trainer import ENV, read_metrics, trainer_cmd

    exp = tmp_path / name
    proc = run_process(trainer_cmd(1, f"experiment.exp_dir={exp}", *SMALL, *overrides),
                       cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return [m["lm_loss"] for m in read_metrics(exp) if "lm_loss" in m]


def _checkpoint_tensors(iteration_dir):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = iteration_dir.parent / f"{iteration_dir.name}.pt"
    dcp_to_torch_save(str(iteration_dir), str(out))
    return torch.load(out, weights_only=False)


def test_frozen_fp8_tables_keep_their_bytes_while_the_backbone_trains(tmp_path):
    from launch import REPO

    from engram_train.config import EngramConfig
    from engram_train.engram.engram_module import Engram

    ckpt = tmp_path / "ckpt"
    losses = _train(tmp_path, "frozen", "train.train_iters=3", f"checkpoint.save={ckpt}",
                    *FP8_FROZEN)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    saved = _checkpoint_tensors(ckpt / "iter_0000003")
    assert not any("multi_head_embedding" in k for k in saved if k.startswith("optimizer."))
    config = EngramConfig(
        use_engram=True, engram_tokenizer_name_or_path=str(REPO / "examples/data/tokenizer"),
        engram_vocab_size=[20011, 20011], max_ngram_size=3, n_embed_per_ngram=64,
        n_head_per_ngram=4, engram_layer_ids=[1, 3], engram_table_dtype="fp8_e4m3",
        engram_freeze_tables=True)  # deepseek_v3_tiny's Engram
    fresh = Engram(config, hidden_size=64, layer_id=1).state_dict()
    prefix = "decoder.layers.1.engram."
    table = saved[prefix + "multi_head_embedding.weight"]
    assert table.dtype == FP8_DTYPE
    assert torch.equal(table.view(torch.uint8),
                       fresh["multi_head_embedding.weight"].view(torch.uint8))
    assert torch.equal(saved[prefix + "multi_head_embedding.weight_scale"],
                       fresh["multi_head_embedding.weight_scale"])
    assert not torch.equal(saved[prefix + "norm1.0.weight"], fresh["norm1.0.weight"])  # trained


def test_trained_fp8_save_and_resume_give_the_losses_of_a_run_without(tmp_path):
    """Host placement saved at 2 of 4 and resumed there against device placement without a
    save: the same losses bit for bit (the placements read and update the same bytes)."""
    ckpt = tmp_path / "ckpt"
    plain = _train(tmp_path, "plain", "train.train_iters=4", *FP8_TRAINED,
                   "model.engram_table_placement=device")
    saved = _train(tmp_path, "saved", "train.train_iters=4", f"checkpoint.save={ckpt}",
                   "checkpoint.save_interval=2", *FP8_TRAINED)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")  # resume mid-run
    resumed = _train(tmp_path, "resumed", "train.train_iters=4", f"checkpoint.load={ckpt}",
                     *FP8_TRAINED)
    assert len(plain) == 4 and saved == plain and resumed == plain[2:]
    from torch.distributed.checkpoint import FileSystemReader

    saved_state = FileSystemReader(str(ckpt / "iter_0000002")).read_metadata().state_dict_metadata
    row_moments = [m.properties.dtype for k, m in saved_state.items() if "exp_avg_sq_row" in k]
    assert row_moments and set(row_moments) == {torch.bfloat16}  # the bf16 row moment is saved
    from engram_train.export import ExportError, export_checkpoint

    with pytest.raises(ExportError, match="engram_table_dtype=fp8_e4m3"):  # no scales there yet
        export_checkpoint(ckpt, tmp_path / "export", config=tmp_path / "saved" / "config.yaml",
                          verify=False)
