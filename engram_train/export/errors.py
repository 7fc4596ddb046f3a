"""The export's error: the message names the input to fix."""


class ExportError(ValueError):
    """The export cannot be made; the message names the input to fix."""
