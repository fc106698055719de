#!/usr/bin/env bash
# Creates .venv with pjax and its test references (CPU only). Used by .ci/run and the README.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, pinned: an unpinned torch pulls several GB of CUDA wheels.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# speculators declares torchvision/torchaudio and friends; install it alone and add what it imports.
python -m pip install -q --no-deps "speculators==0.9.0"
python -m pip install -q "transformers==5.19.0" "datasets==5.1.0" pydantic pydantic-settings loguru openai hs-connectors aiohttp httpx
python -c "import speculators.models.peagle, transformers, jax; print('jax', jax.__version__, 'transformers', transformers.__version__)"
