"""``python -m cloob_core.cli``: the ``cloob`` command."""

from cloob_core.cli import run

run()
