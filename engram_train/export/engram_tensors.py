"""The Engram tensors of a checkpoint against the module the run config builds: every layer
present, every tensor of the right shape, the stored head offsets equal to the config's."""

from __future__ import annotations

from engram_train.engram.variant import engram_branch_class
from engram_train.engram.reference_io import reference_name
from engram_train.export.checkpoint_reader import DistCheckpointReader
from engram_train.export.export_errors import ExportError
from engram_train.export.format import ENGRAM_KEY, OFFSETS


def engram_layer_keys(reader: DistCheckpointReader) -> dict[int, dict[str, str]]:
    """{global layer: {our parameter name: checkpoint key}} of every Engram layer stored."""
    layers: dict[int, dict[str, str]] = {}
    for key in reader.model_keys():
        match = ENGRAM_KEY.match(key)
        if match:
            layers.setdefault(int(match.group(1)), {})[match.group(2)] = key
    return layers


def check_engram_tensors(reader: DistCheckpointReader, engram, hidden_size: int, mapping,
                     where: str) -> dict[int, dict[str, str]]:
    """Every Engram tensor present with the shape the config implies (and the stored head
    offsets equal to the ones the config's primes give); returns `engram_layer_keys`."""
    stored = engram_layer_keys(reader)
    expected_ids = sorted(engram.engram_layer_ids)
    if sorted(stored) != expected_ids:
        raise ExportError(
            f"the checkpoint has Engram layers {sorted(stored)}, {where} says engram_layer_ids="
            f"{list(engram.engram_layer_ids)}: pass the run config this checkpoint was trained "
            "with (--config)"
        )
    fix = ("engram_vocab_size, max_ngram_size, n_head_per_ngram, n_embed_per_ngram, "
           "engram_layer_ids, engram_hc_mult, engram_kernel_size or hidden_size in "
           f"{where} differ from training: pass the run config this checkpoint was trained with")
    for layer_id, keys in stored.items():
        module = engram_branch_class(engram)(engram, hidden_size, layer_id, device="meta")
        want = {name: tuple(t.shape) for name, t in module.state_dict().items()}
        missing, extra = sorted(set(want) - set(keys)), sorted(set(keys) - set(want))
        if missing or extra:
            raise ExportError(
                f"layer {layer_id}: the checkpoint's Engram tensors differ from the module the "
                f"config builds (missing {missing}, unexpected {extra}); {fix}"
            )
        for name, shape in want.items():
            got = reader.tensors[keys[name]].shape
            if got != shape:
                raise ExportError(
                    f"layer {layer_id}: {reference_name(name)} has shape {got} in the checkpoint, "
                    f"{shape} from the config; {fix}"
                )
        offsets = reader.read(keys[OFFSETS]).tolist()
        if offsets != mapping.offsets[layer_id].tolist():
            raise ExportError(
                f"layer {layer_id}: stored head offsets differ from the config's primes; {fix}"
            )
    return stored
