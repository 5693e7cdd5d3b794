#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv and install Hearth into it.
#   scripts/setup.sh          runtime dependencies
#   scripts/setup.sh dev      plus the test tools
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "Hearth needs Python 3.10 or newer (found: $("$PYTHON" --version 2>&1)). Set PYTHON=/path/to/python3." >&2
    exit 1
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
extras=""
[ "${1:-}" = "dev" ] && extras="[dev]"
# Reinstall only when pyproject.toml changed since the last install.
stamp=".venv/.hearth-installed${extras}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".${extras}"
    touch "$stamp"
fi
