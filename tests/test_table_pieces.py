"""Engram tables saved as row-block pieces (engram/table_pieces.py): a checkpoint saved as one
piece per tensor (the layout before pieces) loads into pieces and the other way round, a load
of part of the rows (another sharding) reads the overlap, and the load writes into the live
tensor (the merge hands back its memory). One process, megatron dist_checkpointing on gloo."""

import os

import pytest
import torch
import torch.distributed as dist

from launch import free_port

ROWS, D = 1000, 16


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    from engram_train.runtime.patches import apply_megatron_fixes, install_cpu_compat

    install_cpu_compat()
    apply_megatron_fixes()
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def single(key, tensor, rows, start):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return ShardedTensor(key, tensor, tensor.dtype, tuple(tensor.shape), (rows, *tensor.shape[1:]),
                         (start,) + (0,) * (tensor.dim() - 1), axis_fragmentations=None,
                         replica_id=0)


def pieces(key, tensor, rows, start, nbytes, monkeypatch):
    from engram_train.engram.table_pieces import row_pieces_factory

    monkeypatch.setenv("ENGRAM_TABLE_PIECE_BYTES", str(nbytes))
    return row_pieces_factory(key, tensor, rows, start, 0)


def save(path, state):
    from megatron.core import dist_checkpointing

    path.mkdir()
    dist_checkpointing.save(state, str(path))


def load(path, state):
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(state, str(path))


def tables():
    torch.manual_seed(0)
    return {"w": torch.randn(ROWS, D).to(torch.bfloat16), "row": torch.rand(ROWS, 1)}


@pytest.mark.parametrize("saved,loaded", [("single", 640), (640, "single"), (640, 3000),
                                          (3000, 640)])
def test_either_layout_loads_into_the_other(tmp_path, monkeypatch, saved, loaded):
    """Piece sizes in bytes (640: 20 rows of bf16 w, 160 of the row vector), or one piece."""
    ref = tables()

    def state(values, layout):
        if layout == "single":
            return {k: single(k, v, ROWS, 0) for k, v in values.items()}
        return {k: pieces(k, v, ROWS, 0, layout, monkeypatch) for k, v in values.items()}

    save(tmp_path / "ckpt", state(ref, saved))
    live = {k: torch.zeros_like(v) for k, v in ref.items()}
    out = load(tmp_path / "ckpt", state(live, loaded))
    for k, v in ref.items():
        assert torch.equal(live[k], v), k
        assert out[k].data_ptr() == live[k].data_ptr() and out[k].shape == v.shape
    if saved != "single":
        files = os.listdir(tmp_path / "ckpt")
        assert any(f.endswith(".distcp") for f in files)


def test_pieces_tile_the_rows_and_a_part_loads_the_overlap(tmp_path, monkeypatch):
    """Another sharding: rows [300, 700) of a table saved as pieces whose bounds differ."""
    from megatron.core.dist_checkpointing.mapping import apply_factories

    ref = tables()["w"]
    state = {"w": pieces("w", ref, ROWS, 0, 640 * 3 + 32, monkeypatch)}
    built = dict(state)
    apply_factories(built)
    offsets = [(p.global_offset[0], p.local_shape[0]) for p in built["w"]]
    assert offsets[0][0] == 0 and sum(n for _, n in offsets) == ROWS
    assert all(a + n == b for (a, n), (b, _) in zip(offsets, offsets[1:]))
    save(tmp_path / "ckpt", {"w": pieces("w", ref, ROWS, 0, 640 * 3 + 32, monkeypatch)})
    part = torch.zeros(400, D, dtype=torch.bfloat16)
    load(tmp_path / "ckpt", {"w": pieces("w", part, ROWS, 300, 640, monkeypatch)})
    assert torch.equal(part, ref[300:700])


def test_pieces_alias_the_live_memory_with_storages_of_their_own(monkeypatch):
    """megatron's writer clones a view of a larger storage: the pieces are not such views."""
    from megatron.core.dist_checkpointing.mapping import apply_factories

    from engram_train.engram.table_pieces import _merge

    w = tables()["w"]
    built = {"w": pieces("w", w, ROWS, 0, 640, monkeypatch)}
    apply_factories(built)
    assert len(built["w"]) == 50
    for p in built["w"]:
        assert p.data.untyped_storage().nbytes() == p.data.nbytes
    assert built["w"][1].data.data_ptr() == w[20:].data_ptr()
    assert _merge([p.data for p in built["w"]]) is w
    a, b = torch.ones(3, 2), torch.zeros(2, 2)
    assert torch.equal(_merge([a, b]), torch.cat([a, b]))


def test_a_row_vector_is_saved_as_a_column_and_loads_back_into_the_live_vector(tmp_path,
                                                                                monkeypatch):
    """rowwise_adam's row moment [rows] is saved as [rows, 1] (as one-piece checkpoints hold
    it); the load hands back the live vector."""
    from engram_train.engram.table_pieces import as_column

    torch.manual_seed(1)
    vector = torch.rand(ROWS)
    table = torch.zeros(ROWS, D)
    save(tmp_path / "old", {"v": single("v", vector.view(-1, 1), ROWS, 0)})
    live = torch.zeros(ROWS)
    out = load(tmp_path / "old", {"v": as_column(pieces("t", table, ROWS, 0, 640, monkeypatch), "v", live)})
    assert torch.equal(live, vector) and out["v"] is live
    save(tmp_path / "new", {"v": as_column(pieces("t", table, ROWS, 0, 640, monkeypatch), "v", vector)})
    column = torch.zeros(ROWS, 1)
    load(tmp_path / "new", {"v": single("v", column, ROWS, 0)})
    assert torch.equal(column.view(-1), vector)
