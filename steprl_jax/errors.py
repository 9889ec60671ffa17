"""What went wrong, by whose hand: the error classes the entry points tell apart.

    BadInput        the user's input is at fault (a config field, a file, a line, an argument);
                    the message names it. The main job prints it as one line and exits 2.
    ConfigError     a config field (or a checkpoint's config) holds a value that is not allowed.

Anything else that escapes a job is a crash: one line, the traceback in the workdir's log, exit 1.
This module imports nothing from the project, so that any layer can use it.
"""
from __future__ import annotations


class BadInput(ValueError):
    """Bad user input; the message names the file, line, field or argument at fault."""


class ConfigError(BadInput):
    """A config field holds a value that is not allowed; the message names the field and the value."""
