#!/usr/bin/env bash
# Set everything up and start the Hearth desktop app on the starter model (fetched on first run).
# Without a display (no DISPLAY / WAYLAND_DISPLAY on Linux) it starts the terminal chat instead;
# `./run.sh --terminal [hearth chat options]` always does.
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh gui
if [ "${1:-}" = "--terminal" ]; then
    shift
    exec .venv/bin/hearth chat "$@"
fi
if [ "$(uname -s)" = "Linux" ] && [ -z "${DISPLAY:-}" ] && [ -z "${WAYLAND_DISPLAY:-}" ] \
    && [ -z "${QT_QPA_PLATFORM:-}" ]; then
    echo "No display found: starting the terminal chat (hearth chat)." >&2
    exec .venv/bin/hearth chat "$@"
fi
exec .venv/bin/hearth-app "$@"
