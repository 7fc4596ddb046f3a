"""The project's error root: every error engram_train raises on purpose derives from
`EngramError`, so that an entry point tells the user's mistake (a message, exit status 1) from a
bug (a traceback) with one ``except``. Each class keeps the built-in base it had (``ValueError``,
``RuntimeError``, ...) for callers that catch those."""

from __future__ import annotations


class EngramError(Exception):
    """An error the project raises on purpose; its message names the input and the fix."""


class ConfigError(EngramError, ValueError):
    """A run configuration that cannot work; the message names the key and the fix."""
