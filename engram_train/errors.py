"""The project's error root: every error engram_train raises on purpose derives from
`EngramError`, so that an entry point tells the user's mistake (a message, exit status 1) from a
bug (a traceback) with one ``except``. Each class keeps the built-in base it had (``ValueError``,
``RuntimeError``, ...) for callers that catch those."""

from __future__ import annotations


class EngramError(Exception):
    """An error the project raises on purpose; its message names the input and the fix."""


class ConfigError(EngramError, ValueError):
    """A run configuration that cannot work; the message names the key and the fix."""


class ConfigTypeError(ConfigError, TypeError):
    """A setting of the wrong type (a string where an int goes, ...); names the key and the type."""


class InputError(EngramError, ValueError):
    """An argument the Python API cannot work with (a tensor's shape, dtype or range, a value
    out of its range); the message names the argument and what it must be."""


class InputTypeError(InputError, TypeError):
    """An argument of the wrong type; names the argument and the type it takes."""
