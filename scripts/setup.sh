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
[ "${1:-}" = "gui" ] && extras="[gui]"
# Reinstall only when pyproject.toml changed since the last install.
stamp=".venv/.hearth-installed${extras}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".${extras}"
    touch "$stamp"
fi
# The desktop app's Qt needs a few system libraries (on a bare Debian/Ubuntu the X11 plugin's xcb
# helpers are missing); offscreen tests need none of them.
if [ -n "$extras" ] && [ "$(uname -s)" = "Linux" ]; then
    qxcb=$(ls .venv/lib/python3*/site-packages/PySide6/Qt/plugins/platforms/libqxcb.so 2>/dev/null | head -1)
    if [ -n "$qxcb" ] && ldd "$qxcb" | grep -q "not found"; then
        pkgs="libxcb-icccm4 libxcb-keysyms1 libxcb-cursor0 libxkbcommon-x11-0 libegl1 libfontconfig1"
        if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
            apt-get install -y -qq $pkgs >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq $pkgs) \
                || echo "setup: could not install $pkgs; the app needs them on an X11 display" >&2
        else
            echo "setup: the desktop app needs these system packages for an X11 display:" >&2
            echo "    sudo apt-get install $pkgs" >&2
        fi
    fi
fi
