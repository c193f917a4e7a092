#!/bin/bash
# H200: overload probe of ocr_cls, default config vs variants; py-spy during the DUMP_AT level.
# Carry .device/overload (site.tar.xz: pruned Ray 2.60; extra.tar.xz: pyclipper, shapely; models.tar.xz:
# the OCR ONNX files): see "Running it on the H200 machine". Results go to $OUT.
. bench/h200_overload_env.sh
export RAY_AUTH_MODE=token RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH=2147483647 RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=0
MODEL=${MODEL:-ocr_cls}; SHAPE=${SHAPE:-1,3,48,192}
i=0
while IFS= read -r variant; do
  i=$((i+1)); echo "=== variant $i: $variant"
  sed "s|      repository: engines|      repository: engines\n      models: [ocr_det, ocr_cls, ocr_rec, tiny_cnn, mid_cnn, resnet18]\n      deployments: {$variant}|" serve_config.yaml > /tmp/cfg.yaml
  setsid python3 -m deployments.run /tmp/cfg.yaml > $OUT/serve$i.log 2>&1 < /dev/null &
  SP=$!
  for t in $(seq 150); do curl -sf localhost:8000/v2/health/ready >/dev/null && break; sleep 1; done
  echo "ready after $t s"
  for c in ${LEVELS:-256 512}; do
    if [ $c = ${DUMP_AT:-512} ]; then
      ( sleep 3.5; ps -eo pid,args | grep -E "ServeReplica|haproxy" | grep -v grep > $OUT/procs$i.txt
        for p in $(ps -eo pid,args | grep -E "ServeReplica:models:(router|model-$MODEL)" | grep -v grep | awk '{print $1}'); do
          timeout 6 py-spy record --pid $p --nonblocking -d 2 -r 200 -f raw -o $OUT/v$i-$p.txt > /dev/null 2>&1 & done; wait
        curl -s "localhost:8404/stats;csv" > $OUT/haproxy$i.csv ) &
      DP=$!
    fi
    python3 -m bench.loadgen --url http://127.0.0.1:8000 --model $MODEL --shape $SHAPE --binary --concurrency $c \
       --duration-s ${DUR:-4} --warmup-s 2 --processes 4 --out $OUT/v$i-c$c.json 2>&1 | grep -v "^INFO\|^(\|WARNING" | tail -2
  done
  wait $DP 2>/dev/null
  kill -INT -$SP; sleep 6; kill -9 -$SP 2>/dev/null; pkill -9 -f haproxy; ray stop --force > /dev/null 2>&1; sleep 2
done <<< "${VARIANTS:-}"
echo done
