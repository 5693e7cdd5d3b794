#!/usr/bin/env bash
# Package build/dist/Hearth.app (the PyInstaller spec's BUNDLE, made by installer/build.sh on macOS)
# into a drag-to-Applications disk image.
#
#   installer/macos/make_dmg.sh VERSION [APP] [OUT_DIR]
#
# Uses create-dmg (brew install create-dmg) when installed, for a laid-out window; else plain
# hdiutil. Signing and notarization run when MACOS_SIGN_IDENTITY ("Developer ID Application: ...")
# and, for notarization, MACOS_NOTARY_PROFILE (a `xcrun notarytool store-credentials` profile) are set.
# Output: dist/Hearth-VERSION-macos-ARCH.dmg
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
version=${1:?usage: make_dmg.sh VERSION [APP] [OUT_DIR]}
app=${2:-$root/build/dist/Hearth.app}
out=${3:-$root/dist}
[ -d "$app" ] || { echo "make_dmg.sh: $app not found: run installer/build.sh on macOS first" >&2; exit 1; }
command -v hdiutil >/dev/null || { echo "make_dmg.sh: hdiutil (macOS) is needed" >&2; exit 1; }
mkdir -p "$out"
dmg="$out/Hearth-$version-macos-$(uname -m).dmg"
rm -f "$dmg"

if [ -n "${MACOS_SIGN_IDENTITY:-}" ]; then
    # hardened runtime; Numba's JIT needs to map writable+executable memory
    ent=$(mktemp)
    cat >"$ent" <<PLIST
<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">
<plist version="1.0"><dict>
  <key>com.apple.security.cs.allow-jit</key><true/>
  <key>com.apple.security.cs.allow-unsigned-executable-memory</key><true/>
  <key>com.apple.security.cs.disable-library-validation</key><true/>
</dict></plist>
PLIST
    codesign --force --deep --timestamp --options runtime --entitlements "$ent" \
        --sign "$MACOS_SIGN_IDENTITY" "$app"
    codesign --verify --deep --strict "$app"
fi

stage=$(mktemp -d)
cp -R "$app" "$stage/"
if command -v create-dmg >/dev/null; then
    create-dmg --volname "Hearth $version" --window-size 560 360 --icon-size 128 \
        --icon "Hearth.app" 150 170 --hide-extension "Hearth.app" --app-drop-link 410 170 \
        "$dmg" "$stage"
else
    ln -s /Applications "$stage/Applications"
    hdiutil create -volname "Hearth $version" -srcfolder "$stage" -ov -format UDZO "$dmg"
fi
rm -rf "$stage"

if [ -n "${MACOS_SIGN_IDENTITY:-}" ]; then
    codesign --force --timestamp --sign "$MACOS_SIGN_IDENTITY" "$dmg"
    if [ -n "${MACOS_NOTARY_PROFILE:-}" ]; then
        xcrun notarytool submit "$dmg" --keychain-profile "$MACOS_NOTARY_PROFILE" --wait
        xcrun stapler staple "$dmg"
    fi
fi
echo "$dmg"
