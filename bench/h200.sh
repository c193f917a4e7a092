#!/usr/bin/env bash
# The H200 runs of docs/h200.md, one step per device call, from the repository root
# there (the device tool sends /work/main's tree; this branch travels as .device/gpu/repo):
#   part N    carry .device/b/N (all but the last; bench/h200_bundle.sh makes them): one part of the bundle to /tmp/b
#   bundle    carry the last .device/b/N: join the parts, then what setup and ray do below, the code from this
#             tree (not .device/gpu/repo): all set up in as many calls as parts (7)
#   chunk N   carry .device/gpu/ortgpu/N (N = 0..3): the onnxruntime-gpu wheel's parts to /tmp/gpu
#   setup     carry ortgpu/4, repo, cache, extra: unpack onnxruntime-gpu to /tmp/site, the code to
#             /tmp/w, rapidocr + pyclipper + shapely to /tmp/extra, make the models
#   ray       carry .device/gpu/site.tar.xz: Ray Serve 2.60 (pruned) to /tmp/py/site
#   launch | inproc | graphs | auto | graphmem | stages | tests | embed | frontdoors | fronts | firstclient | engine | serve | batching | padded | padded8 | scaleout | onehop | together | pool | poolhop | autoscale | cpu | metrics | warmup | dashboard | placement
#             (outputs to $OUT)
set -uo pipefail
D=$PWD/.device/gpu
export PYTHONPATH=/tmp/w:/tmp/site:/tmp/extra:/tmp/py/site PYTHONUNBUFFERED=1 PATH=/tmp/py/site/bin:$PATH
HTTP="--duration-s 3 --warmup-s 1 --processes 4"
case "$1" in
  part) mkdir -p /tmp/b && cp .device/b/"$2"/b.part* /tmp/b/ && ls -la /tmp/b ;;
  bundle)
    cp .device/b/*/b.part* /tmp/b/ && (cd /tmp && cat /tmp/b/b.part* | tar xf -) && rm -rf /tmp/b || exit 1
    B=/tmp/bundle; bash $B/ortgpu/unpack.sh /tmp/site || exit 1
    rm -rf /tmp/w /tmp/extra /tmp/extra2 && mkdir -p /tmp/w /tmp/py
    tar cf - --exclude=./.device . | tar xf - -C /tmp/w
    xz -dc $B/extra.tar.xz | tar xf - -C /tmp && xz -dc $B/extra2.tar.xz | tar xf - -C /tmp && cp -r /tmp/extra2/. /tmp/extra/
    mkdir -p /tmp/w/engines/.cache && cp $B/cache/*.whl /tmp/w/engines/.cache/
    python3 -m pip install -q --no-deps --no-compile --target /tmp/extra /tmp/w/engines/.cache/rapidocr*.whl
    xz -dc $B/site.tar.xz | tar xf - -C /tmp/py && rm -rf $B
    cd /tmp/w && python3 -m deployments.runtime.tools.prepare --root engines | tail -3
    python3 -c 'import onnxruntime as o, ray, tritonclient.grpc; print(o.__version__, o.get_available_providers(), ray.__version__)'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv ;;
  chunk) mkdir -p /tmp/gpu && cp "$D/ortgpu/$2"/part* /tmp/gpu/ && ls -la /tmp/gpu ;;
  setup)
    bash "$D/ortgpu/4/unpack.sh" /tmp/site || exit 1
    rm -rf /tmp/w /tmp/extra && cp -r "$D/repo" /tmp/w && cp -r "$D/extra" /tmp/extra
    mkdir -p /tmp/w/engines/.cache && cp "$D"/cache/*.whl /tmp/w/engines/.cache/
    python3 -m pip install -q --no-deps --no-compile --target /tmp/extra /tmp/w/engines/.cache/*.whl
    cd /tmp/w && python3 -m deployments.runtime.tools.prepare --root engines | tail -3
    python3 -c 'import onnxruntime as o; print(o.__version__, o.get_available_providers())'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv ;;
  ray) mkdir -p /tmp/py && xz -dc "$D/site.tar.xz" | tar xf - -C /tmp/py && python3 -c 'import ray; print(ray.__version__)' ;;
  tests) export TRITON_CLIENT_EXAMPLES=$PWD/.device/examples/src/python/examples; cd /tmp/w && python3 -m pytest -q -rs -s -p no:cacheprovider ${TESTS:-tests/gpu tests/unit/test_backend_select.py} 2>&1 | tee "$OUT/tests.log" | grep -v "^\s*$" | tail -60 ;;
  embed) cd /tmp/w && python3 -m bench.embed --clients 1,16,64,256 --gpu-fraction 0.25 \
      --variants ${VARIANTS:-unbatched,joined,bucketed,bucketed_padded} --duration-s 4 --warmup-s 2 --processes 4 ${EMBED_ARGS:-} \
      --out "$OUT/embed.json" 2>&1 | grep -av "^INFO\|^\s*$" | tail -40 ;;
  frontdoors) cd /tmp/w && python3 -m bench.frontdoors --gpu-fraction ${GPU_FRACTION:-0.04} --replicas ${REPLICAS:-1,8} \
      --clients ${CLIENTS:-1,16,64,256} --variants ${VARIANTS:-unbatched,padded,echo} --protocols ${PROTOCOLS:-http,grpc,shm} \
      $HTTP --out "$OUT" 2>&1 | grep -av "^INFO\|^\s*$" | tail -90 ;;
  fronts) cd /tmp/w && for f in ${FRONTS:-router haproxy}; do python3 -m bench.frontdoors --grpc-front $f \
      --gpu-fraction ${GPU_FRACTION:-0.04} --replicas ${REPLICAS:-8} --clients ${CLIENTS:-1,16,64} --variants unbatched \
      --protocols http,grpc $HTTP --out "$OUT/$f${TAG:-}" 2>&1 | grep -a "^| [0-9]\|added over"; done ;;
  firstclient) cd /tmp/w && python3 -m bench.throughput --scenarios batching --models resnet18,tiny_cnn \
      --batched resnet18,tiny_cnn --padded --preferred-batch-size 8 --batch-levels 1,16,64 --gpu-fraction 0.1 \
      $HTTP --out "$OUT" 2>&1 | grep -av "^INFO\|^\s*$" | tail -40 ;;
  engine) cd /tmp/w && python3 -m bench.gpu_engine --duration-s 1.5 --out "$OUT" 2>&1 | tail -80 ;;
  serve) EX=$PWD/.device/examples/src/python/examples; cd /tmp/w && timeout 300 python3 -m bench.gpu_serve_check --config serve_config.gpu.yaml --churn 30 --examples "$EX" --out "$OUT" 2>&1 | tail -60 ;;
  batching) cd /tmp/w && python3 -m bench.throughput --scenarios batching --models resnet18 \
      --batched resnet18,tiny_cnn,ocr_cls,ocr_rec --batch-levels 1,16,64 --gpu-fraction 0.1 $HTTP --out "$OUT" 2>&1 | tail -40 ;;
  padded) cd /tmp/w && python3 -m bench.throughput --scenarios batching --models resnet18 --batched resnet18 --padded \
      --preferred-batch-size 8 --trace --batch-levels 1,16,64 --gpu-fraction 0.1 $HTTP --out "$OUT" 2>&1 | grep -av "^INFO\|^\s*$" | tail -40 ;;
  padded8) nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -lms 500 > "$OUT/gpu_util.csv" & SMI=$!
    (while :; do echo "$(date +%s.%N) $(head -1 /proc/stat)"; sleep 0.5; done > "$OUT/proc_stat.txt") & STAT=$!
    cd /tmp/w && python3 -m bench.throughput --scenarios batching --models resnet18 --batched resnet18 --padded \
      --preferred-batch-size 8 --model-replicas ${REPLICAS:-8} --batch-levels 64,128 --gpu-fraction 0.04 $HTTP --out "$OUT" 2>&1 \
      | grep -av "^INFO\|^\s*$" | tail -40; kill $SMI $STAT ;;
  scaleout) cd /tmp/w && python3 -m bench.throughput --scenarios scaleout --models tiny_cnn,resnet18,ocr_cls,ocr \
      --replicas 1,2,4,8 --gpu-fraction 0.02 --scaleout-concurrency 64 $HTTP --out "$OUT" 2>&1 | tail -40 ;;
  onehop) cd /tmp/w && python3 -m bench.throughput --scenarios scaleout --models tiny_cnn --replicas 1,2,4,8 \
      --gpu-fraction 0.02 --scaleout-concurrency 128 $HTTP --out "$OUT" 2>&1 | grep -av "^INFO\|^\s*$" | tail -40 ;;
  together) cd /tmp/w && python3 -m bench.throughput --scenarios hop,alone,together --models tiny_cnn,resnet18,ocr_cls --levels 32 \
      --gpu-fraction 0.1 --together-concurrency 32 $HTTP --out "$OUT" 2>&1 | grep -av "^INFO\|^\s*$" | tail -40 ;;
  pool) cd /tmp/w && python3 -m bench.throughput --scenarios pool --models tiny_cnn --batched "" --pool-model tiny_cnn \
      --router-replicas 1,2,4 --pool-replicas 4 --pool-concurrency 64,128 --gpu-fraction 0.1 $HTTP --out "$OUT" 2>&1 \
      | grep -av "^INFO\|^\s*$" | tail -30 ;;
  poolhop) cd /tmp/w && python3 -m bench.throughput --scenarios pool --models tiny_cnn --batched "" --pool-model tiny_cnn \
      --router-replicas 1 --pool-replicas ${POOL_REPLICAS:-4} --pool-concurrency 64,128 --gpu-fraction 0.1 $HTTP --out "$OUT" 2>&1 \
      | grep -av "^INFO\|^\s*$" | tail -30 ;;
  autoscale) cd /tmp/w && timeout 400 python3 -m bench.autoscale --model simple --clients 8,64,256 --load-s 25 --after-s 40 \
      --autoscaling '{"max_replicas": 8}' --out "$OUT/autoscale.json" 2>&1 | grep -av "^INFO\|^\s*$" | tail -90 ;;
  cpu) cd /tmp/w && python3 -m bench.throughput --scenarios scaleout --models resnet18,ocr --backend onnxruntime \
      --replicas 1,8 --scaleout-concurrency 64 $HTTP --out "$OUT" 2>&1 | tail -30 ;;
  metrics) cd /tmp/w && timeout 580 python3 -m bench.metrics_overhead --gpu-fraction 0.1 --concurrency 32 \
      --processes 4 --pairs 10 --out "$OUT" 2>&1 | grep -av "^INFO\|^\s*$" | tail -45 ;;
  warmup) cd /tmp/w && python3 -m bench.warmup --backend onnxruntime_cuda --models tiny_cnn,resnet18,ocr_cls \
      --rounds 5 --requests 30 --out "$OUT" 2>&1 | grep -av "^INFO\|^\s*$" | tail -12 ;;
  dashboard) cd /tmp/w && timeout 300 python3 -m bench.dashboard --gpu-fraction 0.1 --concurrency 16 --phase-s 15 \
      --out "$OUT" 2>&1 | grep -av "^INFO\|^\s*$" | tail -8 ;;
  placement) cd /tmp/w && timeout 580 python3 -m bench.placement --policies ${POLICIES:-hash,bytes} --clients 16,64 \
      ${SHIFT_KILL:---no-shift-kill} --models 48 --warmup-s ${WARMUP_S:-20} --duration-s ${DURATION_S:-30} --gpu-fraction 0.2 \
      --out "$OUT/placement.json" 2>&1 | grep -av "^INFO" | tail -40 ;;
  launch) cd /tmp/w && for m in ${WAITS:-auto blocking}; do TRT_SERVE_CUDA_WAIT=$m python3 -m bench.gpu_launch --models resnet18,tiny_cnn \
      --batches 1,8 --out "$OUT/launch-$m.json" 2>&1 | grep -a "^{" | sed "s/^/$m /"; done ;;
  inproc) cd /tmp/w && for c in ${CONCURRENCY:-1 16}; do for v in ${INPROC:-default nographs echo}; do
      case $v in inline) e=TRT_SERVE_INLINE_RUN_US=100000; a=;; nographs) e=TRT_SERVE_CUDA_GRAPHS=0; a=;;
        echo) e=X=1; a=--echo;; fake) e=X=1; a=--fake-model;; *) e=X=1; a=;; esac
      env $e python3 -m bench.replica_inproc --model ${MODEL:-resnet18} --backend onnxruntime_cuda --requests ${REQUESTS:-2000} \
        --concurrency $c $a 2>&1 | grep -a "^{" | sed "s/^/$v c=$c /"; done; done ;;
  graphs) cd /tmp/w && for g in ${GRAPHS:-1 0}; do echo "TRT_SERVE_CUDA_GRAPHS=$g"; TRT_SERVE_CUDA_GRAPHS=$g python3 -m bench.throughput \
      --scenarios batching --models resnet18 --batched resnet18 --padded --preferred-batch-size 8 --model-replicas ${REPLICAS:-8} \
      --batch-levels ${LEVELS:-64,256} --gpu-fraction 0.04 $HTTP --out "$OUT/graphs$g" 2>&1 | grep -a "^batching"; done ;;
  auto) cd /tmp/w && python3 -m bench.throughput --scenarios batching --models resnet18 --batched resnet18 --auto --padded \
      --preferred-batch-size 8 --model-replicas ${REPLICAS:-8} --batch-levels ${LEVELS:-64,256} --gpu-fraction 0.04 $HTTP \
      --out "$OUT/auto" 2>&1 | grep -a --line-buffered "^batching" ;;
  graphmem) cd /tmp/w && python3 -m bench.graph_memory --models ${MODELS:-tiny_cnn,resnet18} --sets ${SETS:-none,1,1-8} 2>&1 \
      | grep -a "^{" | tee "$OUT/graph_memory.log" ;;
  stages) cd /tmp/w && python3 -m bench.replica_cpu --models ${MODELS:-resnet18} --backend onnxruntime_cuda --gpu-fraction 0.1 \
      --rounds ${ROUNDS:-2} --duration-s 5 --warmup-s 2 --stacks /tmp/stacks --out "$OUT/replica_cpu.json" 2>&1 \
      | grep -av "^INFO\|^\s*$" | tail -40; tar czf "$OUT/stacks.tgz" -C /tmp stacks ;;
  *) echo "unknown step $1"; exit 2 ;;
esac
