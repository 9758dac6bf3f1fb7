"""The one error type commands raise for bad input: `main` prints it and exits 2."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input from the user (file, flag, key); the message names what was wrong."""


EXIT_USAGE = 2
