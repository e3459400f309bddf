"""``python -m cloob_core.cli``: the ``cloob`` command."""

import sys

from cloob_core.cli import main

sys.exit(main())
