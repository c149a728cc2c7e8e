"""Registration of the commands beyond `generate` (train, audit, report, ...), kept apart from cli.py
so each command's arguments sit next to its thin call into the library."""

from __future__ import annotations


def register(sub, add_model_args) -> None:
    """Add further subcommands to the `lossless` parser."""
