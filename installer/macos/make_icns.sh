#!/usr/bin/env bash
# Make hearth.icns from the committed PNGs (macOS: iconutil). Usage: installer/macos/make_icns.sh OUT.icns
set -euo pipefail
art="$(cd "$(dirname "$0")/../art/png" && pwd)"
out=${1:?usage: make_icns.sh OUT.icns}
command -v iconutil >/dev/null || { echo "make_icns.sh: iconutil (macOS) is needed" >&2; exit 1; }
set_dir=$(mktemp -d)/hearth.iconset
mkdir -p "$set_dir"
for s in 16 32 128 256 512; do
    cp "$art/hearth-$s.png" "$set_dir/icon_${s}x${s}.png"
done
# the @2x slots are the next size up; 512@2x (1024 px) is left out, iconutil accepts that
cp "$art/hearth-32.png" "$set_dir/icon_16x16@2x.png"
cp "$art/hearth-64.png" "$set_dir/icon_32x32@2x.png"
cp "$art/hearth-256.png" "$set_dir/icon_128x128@2x.png"
cp "$art/hearth-512.png" "$set_dir/icon_256x256@2x.png"
iconutil --convert icns --output "$out" "$set_dir"
rm -rf "$(dirname "$set_dir")"
echo "$out"
