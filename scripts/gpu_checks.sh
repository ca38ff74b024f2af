#!/usr/bin/env bash
# The checks that need a CUDA device, in one run on a GPU machine (never CI): the
# gpu-marked tests and the bundled models generating on CUDA.
#
# A GPU machine without the project's Python dependencies takes them as wheels in
# .gpu_wheels/ (carried beside the checkout), made here with e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 -d .gpu_wheels pydantic pydantic-core \
#     annotated-types typing-inspection transformers huggingface_hub tokenizers \
#     httpx2 httpcore2 truststore
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ -d .gpu_wheels ]; then
  "$PYTHON" -m pip install --no-deps --no-index -q .gpu_wheels/*.whl
fi
"$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', \
transformers.__version__, torch.cuda.get_device_name())"
# Only the modules that hold gpu tests: the others may import what the GPU machine lacks.
mapfile -t gpu_modules < <(grep -rl --include='test_*.py' 'pytest.mark.gpu' tests)
PYTHONPATH=. RAY_AUTH_MODE=disabled "$PYTHON" -m pytest -m gpu "${gpu_modules[@]}" -q \
  -p no:cacheprovider -o addopts="--strict-markers"
status=$?
PYTHONPATH=. "$PYTHON" - <<'PY' || status=1
import torch

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.generation.hf_generation import HfGeneration

for name in ("bundled:policy", "bundled:vlm_policy"):
    policy = HfGeneration({"model_name": name, "device": "cuda", "max_new_tokens": 16})
    ids = policy.tokenizer("What is 2 + 3?", return_tensors="pt")["input_ids"]
    out = policy.generate(BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([ids.shape[1]])))
    n = int(out["generation_lengths"][0])
    print(name, "on", policy.model.device, "generated", n, "tokens, versions",
          out["policy_versions"][0, ids.shape[1]:ids.shape[1] + n].unique().tolist())
PY
exit $status
