#!/usr/bin/env bash
# The style checks a tool can make, run before the tests (scripts/test.sh): ruff over every Python file of
# the repository, mypy over src/roving. The rules and why each is on or off: pyproject.toml, [tool.ruff]
# and [tool.mypy]. Exits non-zero on any finding; to fix what ruff can fix by itself:
#     ruff check --fix .
. "$(dirname "${BASH_SOURCE[0]}")/fail-loudly.sh"
cd "$(dirname "$0")/.."
python3 -m ruff check --no-cache .
python3 -m mypy
