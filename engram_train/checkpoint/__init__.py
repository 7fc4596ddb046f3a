"""Checkpoints through megatron's ``dist_checkpointing``, written so that no run resumes from a
damaged, partial or non-finite checkpoint without saying so (docs/reliability.md).

One concern per module, in dependency order:

- `errors`: the exceptions (each message names the file and the fix);
- `layout`: the save directory (``iter_N``, the tracker, leftovers, retraction), plain files;
- `manifest`: sizes and SHA-256 of every file, written at save and verified at load;
- `selection`: which checkpoint a resume loads, and the fallback past damaged ones;
- `disk`: free space before a save, and a failed save told apart as a full disk;
- `state`: megatron sharded state dicts of model and optimizer, Engram's keys among them;
- `save`, `load`: writing and reading one checkpoint (every rank);
- `partial`: loading everything but Engram (continued pretraining).

Names are imported lazily: the trainer checks a checkpoint directory (`layout`, `manifest`,
`selection`) before megatron-core is imported.
"""

from __future__ import annotations

from engram_train.lazy_exports import lazy_getattr

_EXPORTS = {
    "CheckpointError": "checkpoint_errors",
    "CheckpointSpaceError": "checkpoint_errors",
    "DamagedCheckpointError": "checkpoint_errors",
    "NonFiniteStateError": "checkpoint_errors",
    "MANIFEST": "layout",
    "TRACKER": "layout",
    "SET_ASIDE_SUFFIX": "layout",
    "has_checkpoints": "layout",
    "iteration_dir": "layout",
    "latest_iteration": "layout",
    "list_checkpoints": "layout",
    "read_tracker": "layout",
    "remove_leftovers": "layout",
    "retract_checkpoints": "layout",
    "checkpoint_bytes": "manifest",
    "file_digest": "manifest",
    "read_manifest": "manifest",
    "check_checkpoint": "manifest",
    "Selection": "selection",
    "resume_candidates": "selection",
    "select_checkpoint": "selection",
    "check_free_space": "disk",
    "OPTIMIZER_METADATA": "state",
    "estimate_checkpoint_bytes": "state",
    "is_engram_key": "state",
    "model_sharded_state_dict": "state",
    "nonfinite_parameter": "state",
    "save_checkpoint": "save",
    "load_checkpoint": "load",
    "load_checkpoint_dir": "load",
    "optimizer_parts": "partial",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
