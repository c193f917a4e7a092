# Sourced by bench/h200_overload.sh and bench/h200_queue_probe.sh: unpack the carried Ray bundle,
# extra packages and OCR models (.device/overload), put them on PYTHONPATH, prepare the generated models.
set -u
D=$PWD/.device/overload
mkdir -p /tmp/py
[ -d /tmp/py/site/ray ] || { tar xJf $D/site.tar.xz -C /tmp/py; tar xJf $D/extra.tar.xz -C /tmp/py; }
[ -d engines/ocr_cls/1 ] || tar xJf $D/models.tar.xz
export PYTHONPATH=/tmp/py/site:/tmp/py/extra:$PWD PATH=/tmp/py/site/bin:$PATH PYTHONUNBUFFERED=1
python3 -c "from pathlib import Path; from deployments.runtime.tools.prepare import prepare_generated; prepare_generated(Path('engines'))" > $OUT/prepare.log 2>&1 || { tail -20 $OUT/prepare.log; exit 1; }
