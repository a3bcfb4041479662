#!/usr/bin/env bash
# One step of the vLLM GPU session, on the GPU machine after `install.sh` (see stage.sh).
# Logs and JSON go to $OUT (the device tool brings them home); docs/data keeps them.
#
#   bash bench/gpu/vllm_session.sh tests          # the gpu tests: demo model; the read path
#                                                 # against stock vLLM and transformers
#   bash bench/gpu/vllm_session.sh card NAME ARGS # full-size NVFP4 (dummy weights) on an
#                                                 # emulated 24 GB card, the product's
#                                                 # defaults; ARGS go to bench/engine_gpu.py
#                                                 # (e.g. --read-path stock); PROFILE=1:
#                                                 # the torch profiler; STACKS=1: the host's
#                                                 # Python sampled per row (dgstacks.py)
#   bash bench/gpu/vllm_session.sh nvfp4|bf16     # full-size shape in a share of the H200
#   bash bench/gpu/vllm_session.sh transformers   # the transformers engine rows, same shapes
#   bash bench/gpu/vllm_session.sh pipeline       # Kafka + Ray + controller + a vLLM worker
#                                                 # (the demo model), three bursts in a row
#   bash bench/gpu/vllm_session.sh pipe-alone     # full-size NVFP4 on the emulated card: the
#   bash bench/gpu/vllm_session.sh pipe-full      # engine alone, then the pipeline (two calls,
#                                                 # one engine start each; /root keeps the first)
#   bash bench/gpu/vllm_session.sh mps-on|mps-off # the MPS control daemon (compute-limited cards)
#   bash bench/gpu/vllm_session.sh calibrate      # which SM share gives each card profile's rate
#   bash bench/gpu/vllm_session.sh followup       # the bisection's second round (next_round.py)
#   bash bench/gpu/vllm_session.sh engines SPEC.. # reads_soak.py engines side by side on the GPU,
#                                                 # each its own 23.6 GiB card and SM share:
#                                                 # SPEC = NAME:PCT[:VAR=VAL[,VAR=VAL]]:SOAK_ARGS
#                                                 # (PCT 100 = the whole GPU); logs and JSON in
#                                                 # $OUT/engines (kept as they grow);
#                                                 # SOAK_ARGS `pytest [PATH]`: a gpu test
#                                                 # file instead (the slow-GPU test)
#
# CARD_PROFILE=l4|a10|rtx4090|rtx3090 (or CARD_PCT=N) with `card`: the emulated card is also
# compute-limited, to the SM share `calibrate` chose for that card (bench/gpu/card/
# card_profiles.py), under MPS (`mps-on` first); the share's measured bf16 rate goes to
# $OUT/card_NAME_share.json beside the figures.
#
# CARD_CONTEXT_GIB (default 1.0) is what the emulated card keeps outside PyTorch's allocator:
# the engine process held 1.0 GiB beyond its allocator's peak on the 2026-12-02 card run.
set -u
root=$PWD
# dgstream/workers (and schemas, topology, infra) are links to the folders: a copy of the
# tree that dropped them gets them back, so `import dgstream.workers` works from $root.
for sub in workers schemas topology infra; do
  [ -e "dgstream/$sub" ] || ln -s "../$sub" "dgstream/$sub"
done
# vLLM finds the project's read path (its plugin) through package metadata only: a
# dist-info for the work tree, first on the path (bench/gpu/dist_info.py).
python3 bench/gpu/dist_info.py /root/dgdist >/dev/null
export PYTHONPATH=/root/dgdist:/root/site:$root PYTHONUNBUFFERED=1
# Stay off the network (there is none) and keep vLLM's caches in one place on the machine.
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
# MPS (when its daemon runs) is reached through these; without a daemon CUDA ignores them.
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
# The SM share of a card profile, from this machine's calibration (`calibrate`).
profile_pct() {
  python3 -c "import json,sys; print(json.load(open('/root/calibration.json'))['profiles'][sys.argv[1]]['percentage'])" "$1"
}
# (A follow-up round leaves $OUT's few file slots to its engines and prints this instead.)
if [ "${1:-}" = followup ] || [ -n "${ROUND:-}" ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt"
fi
# The emulated card: 23.6 GiB is what torch reports of a 24 GB board (bench/gpu/card).
card() {
  export DGSTREAM_CARD_GIB=23.6 DGSTREAM_CARD_REPORT=/tmp/card-$1
  export DGSTREAM_CARD_CONTEXT_GIB=${CARD_CONTEXT_GIB:-1.0}
  export PYTHONPATH=$root/bench/gpu/card:$PYTHONPATH
  rm -rf "$DGSTREAM_CARD_REPORT"
}
# The profiler's tables are small; its traces are not (they stay on the machine).
keep_profile() {
  (cd "/root/prof/$1" && tar czf "$out/profile_$1.tgz" --exclude='*.json.gz' --exclude='*.pt.trace.json*' . ) || true
}
# Kafka's jars and Ray for the pipeline modes (staged with pipeline-wheels.txt).
pipe_env() { export DGSTREAM_KAFKA_LIB=/root/extra/kafka-lib RAY_worker_niceness=0; }
case "${1:-}" in
  tests)
    # Nine tests and six demo-model engine starts (three of them capturing CUDA graphs)
    # and a `vllm serve`: 413 s for the seven before the one-step tests (2026-12-05, an
    # H100), 143 s for one one-step test with its start (an H200). All nine pass 600 s, a
    # device call's limit: run them as two calls, PYTEST_K="not one_step", then
    # PYTEST_K="one_step" (PYTEST_K: the tests pytest's -k selects).
    DGSTREAM_GPU_OUT=$out timeout -k 10 "${RUN_TIMEOUT:-580}" python3 -m pytest tests/workers/engine/test_vllm_gpu.py -m gpu -v -rs \
      ${PYTEST_K:+-k "$PYTEST_K"} -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
    ;;
  card)
    name=$2; shift 2
    card "$name"
    pct=${CARD_PCT:-}
    [ -n "${CARD_PROFILE:-}" ] && pct=$(profile_pct "$CARD_PROFILE")
    if [ -n "$pct" ]; then
      # The share's own rate, measured now, beside the figures.
      python3 bench/gpu/card/calibrate.py --check "$pct" > "$out/card_${name}_share.json"
      cat "$out/card_${name}_share.json"
      export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct
    fi
    prof=()
    [ -n "${PROFILE:-}" ] && { mkdir -p "/root/prof/$name"; prof=(--profile "/root/prof/$name"); }
    # STACKS=1: every process's Python threads sampled during each timed row (dgstacks.py).
    [ -n "${STACKS:-}" ] && export DGSTREAM_STACKS=/root/stacks/$name
    # RUN_TIMEOUT: two card runs in one device call (at most 600 s a call) split it.
    timeout -k 10 "${RUN_TIMEOUT:-560}" python3 bench/engine_gpu.py --engine vllm --quant nvfp4 --batches "${BATCHES:-1,32,256}" \
      --out "$out/card_$name.json" "${prof[@]}" "$@" 2>&1 | tee "$out/card_$name.log"
    [ -n "${PROFILE:-}" ] && keep_profile "$name"
    if [ -n "${STACKS:-}" ]; then
      python3 bench/gpu/card/dgstacks.py "$DGSTREAM_STACKS" --top 30 > "$out/stacks_$name.txt" 2>&1
      tar czf "$out/stacks_$name.tgz" -C "$DGSTREAM_STACKS" . || true
    fi
    ;;
  nvfp4|bf16)
    # NVFP4 inside a 24 GB card's budget; bf16's 47 GiB of weights need more than that.
    budget=23; [ "$1" = bf16 ] && budget=64
    mkdir -p "/root/prof/$1"
    timeout 560 python3 bench/engine_gpu.py --engine vllm --quant "$1" --budget-gib "$budget" \
      --profile "/root/prof/$1" --out "$out/engine_vllm_$1.json" 2>&1 | tee "$out/engine_vllm_$1.log"
    keep_profile "$1"
    ;;
  transformers)
    timeout 560 python3 bench/engine_gpu.py --out "$out/engine_gpu.json" 2>&1 | tee "$out/engine_gpu.log"
    ;;
  pipeline)
    pipe_env
    DGSTREAM_RAY_LOGS_TGZ="$out/pipeline_ray_logs.tgz" timeout 560 python3 bench/pipeline_gpu.py \
      --backend vllm --bursts 3 --out "$out/pipeline_gpu.json" 2>&1 | tee "$out/pipeline_gpu.log"
    ;;
  pipe-alone)
    card pipe_alone; pipe_env
    timeout 560 python3 bench/pipeline_gpu.py --backend vllm --full-size --bursts 3 --stage alone \
      --out "$out/pipe_alone.json" 2>&1 | tee "$out/pipe_alone.log"
    cp "$out/pipe_alone.json" /root/pipe_alone.json
    ;;
  pipe-full)
    card pipe_full; pipe_env
    # The worker actor's and engine core's own logs (Ray's session dir) come back too.
    DGSTREAM_RAY_LOGS_TGZ="$out/pipe_full_ray_logs.tgz" timeout 560 python3 bench/pipeline_gpu.py \
      --backend vllm --full-size --bursts 3 --stage pipeline \
      --alone-json /root/pipe_alone.json --out "$out/pipe_full.json" 2>&1 | tee "$out/pipe_full.log"
    ;;
  mps-on)
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    # (pgrep -x matches at most 15 characters of a name: match the command line.)
    pgrep -f "nvidia-cuda-mps-control -d" >/dev/null || nvidia-cuda-mps-control -d
    echo "MPS control daemon: $(pgrep -f "nvidia-cuda-mps-control -d" || echo none)"
    ;;
  mps-off)
    echo quit | nvidia-cuda-mps-control || true
    ;;
  calibrate)
    python3 bench/gpu/card/calibrate.py --out "$out/calibration.json" 2>&1 | tee "$out/calibration.log"
    cp "$out/calibration.json" /root/calibration.json
    ;;
  engines)
    shift
    work=/root/engines${ROUND:-}; rm -rf "$work"; mkdir -p "$work"
    # Logs and JSON go home as they grow (a device call cut short still brings them).
    dest=$out/engines${ROUND:-}; mkdir -p "$dest"
    # (Logs as they grow; the JSON in one archive at the end: $OUT brings back 8 files.)
    keep() { cp -f "$work"/soak_*.log "$dest"/ 2>/dev/null; }
    ( while sleep 15; do keep; done ) &
    copier=$!
    pids=()
    for spec in "$@"; do
      IFS=: read -r name pct vars rest <<<"$spec"
      (
        # Each engine its own card (memory counted per process: they share the GPU), its
        # own SM share and its own compile caches (concurrent writers of one cache race).
        export DGSTREAM_CARD_GIB=23.6 DGSTREAM_CARD_SHARED=1 DGSTREAM_CARD_REPORT=/root/cards-$name
        export DGSTREAM_CARD_CONTEXT_GIB=${CARD_CONTEXT_GIB:-1.0}
        export PYTHONPATH=$root/bench/gpu/card:$PYTHONPATH
        c=/root/cache-$name
        export VLLM_CACHE_ROOT=$c/vllm TRITON_CACHE_DIR=$c/triton TORCHINDUCTOR_CACHE_DIR=$c/inductor
        export HUMMING_CACHE_DIR=$c/humming XDG_CACHE_HOME=$c/xdg
        export DGSTREAM_READS_DEBUG_DIR=$work/flags-$name
        if [ "$pct" != 100 ]; then export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct; fi
        IFS=, read -ra kv <<<"$vars"
        for v in "${kv[@]}"; do [ -n "$v" ] && export "${v?}"; done
        # CACHE_FROM=OTHER: start from another engine's compile caches (a warm start).
        if [ -n "${CACHE_FROM:-}" ] && [ -d "/root/cache-$CACHE_FROM" ] && [ ! -d "$c" ]; then
          cp -r "/root/cache-$CACHE_FROM" "$c"
        fi
        if [ "${rest%% *}" = pytest ]; then
          # A gpu test file at this share, the slow-GPU test unless named (`pytest PATH`);
          # its JSON lands beside the logs.
          tests=${rest#pytest}; tests=${tests# }
          DGSTREAM_SLOW_GPU_PCT=$pct DGSTREAM_GPU_OUT=$work timeout -k 10 "${RUN_TIMEOUT:-560}" \
            python3 -m pytest "${tests:-tests/workers/engine/test_vllm_slow_gpu.py}" -m gpu -v -s \
            -p no:cacheprovider > "$work/soak_$name.log" 2>&1
        else
          # shellcheck disable=SC2086
          timeout -k 10 "${RUN_TIMEOUT:-560}" python3 bench/gpu/reads_soak.py --name "$name" \
            --out "$work/soak_$name.json" $rest > "$work/soak_$name.log" 2>&1
        fi
        echo "engine $name exited $?" >> "$work/soak_$name.log"
      ) &
      pids+=($!)
    done
    wait "${pids[@]}"
    kill "$copier" 2>/dev/null
    keep
    tar czf "$dest/json.tgz" -C "$work" $(cd "$work" && ls ./*.json 2>/dev/null) 2>/dev/null || true
    for spec in "$@"; do grep -h "^# \|dgstream watch\|passed\|failed\|Error" "$work/soak_${spec%%:*}.log" | tail -n 12; done
    ;;
  followup)
    # The round after the first `engines` round of the bisection: its outcome picks the
    # next engines (bench/gpu/next_round.py says which and why), with no pause between.
    specs=$(python3 bench/gpu/next_round.py /root/engines) || exit 1
    echo "followup: $specs"
    eval "set -- $specs"
    ROUND=2 bash "$0" engines "$@"
    ;;
  *) echo "usage: $0 tests|card NAME [ARGS]|nvfp4|bf16|transformers|pipeline|pipe-alone|pipe-full|mps-on|mps-off|calibrate|engines SPEC..." >&2; exit 2 ;;
esac
