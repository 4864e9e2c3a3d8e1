"""Exceptions that mean "the user gave us something wrong".

The CLI turns every :class:`UserError` into one line on stderr and exit code 2; anything else is a bug
or a runtime failure and keeps its traceback (behind ``--debug`` for the CLI).
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: config, CLI arguments, data, checkpoint. The message says what and how to fix it."""

    exit_code = 2


class ConfigError(UserError):
    """The experiment config is missing, malformed or invalid."""


class CheckpointError(UserError):
    """A checkpoint is missing, truncated, tampered with or incompatible."""


class DataError(UserError):
    """The trial's data cannot be split across the slots as asked."""
