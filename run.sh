#!/usr/bin/env bash
# Set everything up and start Hearth on the starter model (fetched on first run).
# Extra arguments go to `hearth chat` (e.g. ./run.sh --system "Be brief.").
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
exec .venv/bin/hearth chat "$@"
