#!/usr/bin/env bash
# The peer of the project's vLLM read path, on the GPU machine after
# `install.sh`: `vllm serve`'s own /v1/decisions, no plugin, on the full-size NVFP4 shape
# (dummy weights) and the emulated 24 GB card (bench/gpu/card), at concurrency 1, 32 and 256.
# Logs and JSON go to $OUT (the device tool brings them home); docs/data keeps them.
#
#   bash bench/gpu/peer_session.sh [ARGS]     # ARGS go to bench/peer_decisions.py
#                                             # (e.g. --endpoint systemone, --no-joint)
#
# One server start (about 3.5 min with CUDA graphs), then 6 rows of at most 35 s each; the
# script starts no row after 480 s and the whole run is cut at 530 s.
set -u
root=$PWD
# dgstream/workers (and schemas, topology, infra) are links to the folders: a copy of the
# tree that dropped them gets them back, so `import dgstream.workers` works from $root.
for sub in workers schemas topology infra; do
  [ -e "dgstream/$sub" ] || ln -s "../$sub" "dgstream/$sub"
done
out=${OUT:-/tmp/out}
mkdir -p "$out"
if [ ! -f "$root/bench/gpu/card/sitecustomize.py" ]; then
  echo "bench/gpu/card/sitecustomize.py is missing: no emulated card, no run" >&2; exit 2
fi
# The emulated card in every process (this one, the server, its engine core): 23.6 GiB is
# what torch reports of a 24 GB board (bench/gpu/card). Set either variable to override.
export DGSTREAM_CARD_GIB=${DGSTREAM_CARD_GIB:-23.6} DGSTREAM_CARD_REPORT=${DGSTREAM_CARD_REPORT:-/tmp/card-peer}
rm -rf "$DGSTREAM_CARD_REPORT"
# No dist-info of the project on the path: the server could not find the plugin even
# without VLLM_PLUGINS="" (which bench/peer_decisions.py sets for it).
export PYTHONPATH=$root/bench/gpu/card:/root/site:$root PYTHONUNBUFFERED=1
# Stay off the network (there is none).
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt"
timeout -k 5 530 python3 bench/peer_decisions.py --out "$out/peer_decisions.json" \
  --time-budget-s 480 "$@" 2>&1 | tee "$out/peer_decisions.log"
status=${PIPESTATUS[0]}
# Whatever the run left: the server's own log sits beside the JSON (peer_decisions.server.log).
cp -r "$DGSTREAM_CARD_REPORT" "$out/card-peer" 2>/dev/null || true
exit "$status"
