"""The export's error: the message names the input to fix."""

from engram_train.errors import EngramError


class ExportError(EngramError, ValueError):
    """The export cannot be made; the message names the input to fix."""
