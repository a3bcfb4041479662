#!/usr/bin/env bash
# On the GPU machine: reassemble the parts `stage.sh` cut and install the wheels into
# /root/site. Idempotent: a second run on a warm machine is a no-op.
set -euo pipefail
if [ -f /root/site/.complete ]; then echo "wheels already installed in /root/site"; exit 0; fi
cd /root
mkdir -p whl
cat /root/stage/part* | tar xf - -C whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site whl/*.whl
rm -rf /root/extra && mv whl/extra /root/extra
rm -rf /root/stage /root/whl
touch /root/site/.complete
PYTHONPATH=/root/site python3 -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"
