"""The suite's error, apart from both modules that raise it: the suite's run (``suite.py``) and its report
(``suite_report.py``). The report stage imports this, not the run, so that its DVC dependencies stay the report's."""

from __future__ import annotations

from cloob_core.config import ConfigError


class SuiteError(ConfigError):
    """A suite entry that cannot be evaluated, or results that do not cover the suite; names the entry."""
