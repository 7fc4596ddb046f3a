"""The checkpoint errors: each message names the file and what to do."""

from __future__ import annotations

from engram_train.errors import EngramError


class CheckpointError(EngramError, RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file and what to do."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's files differ from what its manifest recorded (or cannot be read)."""


class CheckpointSpaceError(CheckpointError):
    """Not enough free space to save a checkpoint (checked before, or ENOSPC while writing)."""


class NonFiniteStateError(CheckpointError):
    """Parameters hold NaN or inf: such a state is never saved."""


class CheckpointFolderInUseError(CheckpointError):
    """Another run holds the lock of the ``checkpoint.save`` folder."""
