#!/bin/bash
# H200: bench.overload sweep (default config minus the ocr pipeline: no rapidocr there).
# Carry .device/overload (site.tar.xz: pruned Ray 2.60; extra.tar.xz: pyclipper, shapely; models.tar.xz:
# the OCR ONNX files): see "Running it on the H200 machine". Results go to $OUT.
set -u
D=$PWD/.device/overload
mkdir -p /tmp/py
[ -d /tmp/py/site/ray ] || { tar xJf $D/site.tar.xz -C /tmp/py; tar xJf $D/extra.tar.xz -C /tmp/py; }
[ -d engines/ocr_cls/1 ] || tar xJf $D/models.tar.xz
export PYTHONPATH=/tmp/py/site:/tmp/py/extra:$PWD PATH=/tmp/py/site/bin:$PATH PYTHONUNBUFFERED=1
python3 -c "from pathlib import Path; from deployments.runtime.tools.prepare import prepare_generated; prepare_generated(Path('engines'))" > $OUT/prepare.log 2>&1 || { tail -20 $OUT/prepare.log; exit 1; }
sed "s|      repository: engines|      repository: engines\n      models: [ocr_det, ocr_cls, ocr_rec, tiny_cnn, mid_cnn, resnet18]|" serve_config.yaml > cfg-h200.yaml
timeout ${BENCH_TIMEOUT:-380} python3 -m bench.overload --config cfg-h200.yaml --models ${MODELS:-ocr_cls,tiny_cnn} \
  --levels ${LEVELS:-1,4,16,32,64,128,256,512} --processes 4 --duration-s ${DUR:-3} --warmup-s ${WARM:-2} \
  --triton-python '' --out $OUT 2>&1 | grep -v "^INFO\|^(\|WARNING" | tail -40
