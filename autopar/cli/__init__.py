"""Front ends: the ``autopar`` command (``inspect``, ``coverage``, ``calibrate``), its input
parsing and progress output, and the ``make demo`` script (``autopar.cli.demo``)."""

from autopar.cli.main import build_parser, main

__all__ = ["main", "build_parser"]
