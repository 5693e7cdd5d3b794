#!/usr/bin/env bash
# Set everything up and run the whole test suite (lint included). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh dev
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
