#!/bin/bash
# H200: bench.overload sweep (default config minus the ocr pipeline: no rapidocr there).
# Carry .device/overload (site.tar.xz: pruned Ray 2.60; extra.tar.xz: pyclipper, shapely; models.tar.xz:
# the OCR ONNX files): see "Running it on the H200 machine". Results go to $OUT.
. bench/h200_overload_env.sh
sed "s|      repository: engines|      repository: engines\n      models: [ocr_det, ocr_cls, ocr_rec, tiny_cnn, mid_cnn, resnet18]|" serve_config.yaml > cfg-h200.yaml
timeout ${BENCH_TIMEOUT:-380} python3 -m bench.overload --config cfg-h200.yaml --models ${MODELS:-ocr_cls,tiny_cnn} \
  --levels ${LEVELS:-1,4,16,32,64,128,256,512} --processes 4 --duration-s ${DUR:-3} --warmup-s ${WARM:-2} \
  --triton-python '' --out $OUT 2>&1 | grep -v "^INFO\|^(\|WARNING" | tail -40
