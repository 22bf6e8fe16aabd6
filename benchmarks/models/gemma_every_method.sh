#!/usr/bin/env bash
# Every method through `kvcompile generate` on gemma-3-270m at ratio 0.5, and the full cache's answer beside.
cd "$(dirname "$0")/../.."  # the repository root
export KVCOMPILE_CACHE=${KVCOMPILE_CACHE:-$HOME/.cache/kvcompile}
PROMPT=calibration_data/prompts/passkey_2k.txt
.venv/bin/python - <<'PY'
import kvruntime, torch
model, tokenizer = kvruntime.load_model("gemma-3-270m")
ids = tokenizer(open("calibration_data/prompts/passkey_2k.txt").read(), return_tensors="pt").input_ids
with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
print("full cache:", repr(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)))
PY
for method in snapkv kvcompress srh compresskv kvcompose distilled compilerkv; do
  start=$(date +%s.%N)
  answer=$(.venv/bin/kvcompile generate --model gemma-3-270m --method $method --ratio 0.5 --prompt-file $PROMPT --max-new-tokens 16 2>&1)
  rc=$?
  echo "$method (rc $rc, $(printf '%.1f' $(echo "$(date +%s.%N) - $start" | bc)) s): $(echo "$answer" | head -1)"
  echo "$answer" | grep -E "sliding layers|entries removed" | sed 's/^/    /'
done
echo "no --method (the model's tuned_defaults recommends none):"
.venv/bin/kvcompile generate --model gemma-3-270m --prompt-file $PROMPT --max-new-tokens 16 2>&1 | head -3
# The cache folder is keyed by the weights' content; its marker names the model.
folder=$(dirname "$(grep -l '"title": "Gemma-3-270M"' $KVCOMPILE_CACHE/models/*/kvcompile_cache.json | head -1)")
echo "a model folder saved from the GGUF by transformers ($folder):"
.venv/bin/kvcompile generate --model "$folder" --artifact artifacts/gemma-3-270m/distilled_scorer.safetensors --method distilled --ratio 0.5 --prompt-file $PROMPT --max-new-tokens 16 2>&1 | head -1
