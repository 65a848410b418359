"""``python -m rlasync`` is the ``rlasync`` command."""

from rlasync.cli import app

app()
