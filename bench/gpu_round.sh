#!/usr/bin/env bash
# One round of demo-model training on a 2-GPU machine: two runs side by side, one per GPU,
# each from its own starting point, with the held-out check at the end of each.
#   bench/gpu_round.sh NAME_A "ARGS_A" NAME_B "ARGS_B"
# Outputs: build/NAME_{A,B}/ (weights, train_log.json); logs and weights copied to $OUT.
# .whl/ holds the cp312 wheels the image lacks: pydantic, pydantic_core, annotated_types,
# typing_inspection (the engine reads the contract's question model), tokenizers if absent.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
common="--device cuda --batch 768 --workers 14 --experts dense"
CUDA_VISIBLE_DEVICES=0 python3 -m bench.train_demo_model $common $2 --out build/$1 \
  >"$OUT/$1.txt" 2>&1 &
CUDA_VISIBLE_DEVICES=1 python3 -m bench.train_demo_model $common $4 --out build/$3 \
  >"$OUT/$3.txt" 2>&1 &
wait
for n in "$1" "$3"; do
  cp "build/$n/train_log.json" "$OUT/$n.json" 2>/dev/null
  cp "build/$n/model.safetensors" "$OUT/$n.safetensors" 2>/dev/null
  grep -E "held-out|per task|wall" "$OUT/$n.txt"
done
