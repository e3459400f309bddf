"""Build the PrometheusRule resource (infra/k8s/base/prometheusrule.yaml) from the plain rules file that promtool
reads (alerts.rules.yml), so the rules are written once: the Prometheus Operator wants them under ``spec``, and
promtool cannot read that resource.

    python infra/monitoring/build_rule_resource.py          # rewrite the resource
    python infra/monitoring/build_rule_resource.py --check  # exit 1 if it differs from what the rules file gives

The rules are nested as text, not re-dumped, so their comments and folded expressions stay as written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RULES = HERE / "alerts.rules.yml"
RESOURCE = HERE.parent / "k8s" / "base" / "prometheusrule.yaml"
HEADER = """\
# Generated from infra/monitoring/alerts.rules.yml by infra/monitoring/build_rule_resource.py: edit the rules there.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: cloob-alerts
spec:
"""


def build(rules_text: str) -> str:
    """The resource for ``rules_text``: its lines below the leading comments, indented under ``spec``."""
    lines = rules_text.splitlines()
    while lines and (not lines[0].strip() or lines[0].startswith("#")):
        lines.pop(0)
    return HEADER + "".join(f"  {line}\n" if line.strip() else "\n" for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    expected = build(RULES.read_text())
    if args.check:
        if RESOURCE.read_text() != expected:
            script = (HERE / Path(__file__).name).relative_to(HERE.parent.parent)
            print(f"{RESOURCE} is out of date: run python {script}", file=sys.stderr)
            return 1
        return 0
    RESOURCE.write_text(expected)
    return 0


if __name__ == "__main__":
    sys.exit(main())
