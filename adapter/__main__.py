"""``python -m adapter [--json]``: the environment report (``adapter.report``) for bug reports.

Exit status: 0 when the report found no problem, 1 when it lists problems (a patch that could not be
applied, a library that fails to import); the report is printed in full either way. 2 is a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys

from adapter import report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m adapter",
        description="Backend, versions, kernel providers and the patch table of this environment: paste "
                    "the output into bug reports.")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    data = report.collect()
    print(json.dumps(data, indent=2) if args.json else report.render(data))
    return 1 if data["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
