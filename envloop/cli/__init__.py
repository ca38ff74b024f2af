"""The ``envloop`` command (entry point ``envloop.cli:main``)."""

from envloop.cli.main import main

__all__ = ["main"]
