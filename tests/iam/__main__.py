"""`python -m tests.iam FOLDER`: check a recording made outside pytest (TRAINSTACK_IAM_RECORD=FOLDER)."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.iam.check import check_folder, report


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m tests.iam FOLDER (a TRAINSTACK_IAM_RECORD folder)", file=sys.stderr)
        return 2
    findings, checked, principals = check_folder(Path(args[0]))
    calls = ", ".join(f"{p} {n}" for p, n in sorted(principals.items())) or "none"
    for line in report(findings):
        print(line)
    print(f"{checked} authorizations checked, {len(findings)} refused (calls: {calls})")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
