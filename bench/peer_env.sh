#!/usr/bin/env bash
# The llama.cpp peer for bench/peer_cpu.py, in the benchmark's OWN environment (never the
# worker's .venv): build/peer-venv with llama-cpp-python built from its PyPI source for this CPU
# (GGML_NATIVE), and the real base converted to f32 and bf16 GGUF with the converter shipped in
# that source. From the repository root:
#
#   bash bench/peer_env.sh [BASE_DIR]     # default BASE_DIR: data/base (the converted SmolLM2-135M)
#
# ~15-30 min on 2 cores (the C++ build); a second run reuses what is there. The converter needs
# torch and transformers, which the peer venv does not have: it runs under the worker's python
# with the source's own gguf-py (and a sentencepiece of its own) on PYTHONPATH, installing nothing into that environment.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${1:-data/base}
PEER=build/peer-venv
GGUF_DIR=build/peer-gguf
PY=${PYTHON:-.venv/bin/python}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
mkdir -p build "$GGUF_DIR"

if [ ! -x "$PEER/bin/python" ]; then
    python3 -m venv "$PEER"
fi
if ! "$PEER/bin/python" -c 'import llama_cpp' 2>/dev/null; then
    "$PEER/bin/pip" install -q --upgrade pip
    # a native CPU build (this host's ISA: AVX-512/BF16 where the CPU has it), no GPU backends
    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF" \
        CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
        "$PEER/bin/pip" install -v --no-binary llama-cpp-python "llama-cpp-python==$VERSION" gguf
fi

# the converter from the same source the library was built from
SRC=build/peer-src/llama_cpp_python-$VERSION
if [ ! -f "$SRC/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
    mkdir -p build/peer-src
    "$PEER/bin/pip" download -q --no-deps --no-binary :all: -d build/peer-src "llama-cpp-python==$VERSION"
    tar -xzf "build/peer-src/llama_cpp_python-$VERSION.tar.gz" -C build/peer-src
fi
# the converter imports sentencepiece before it falls back to tokenizer.json: a directory of its
# own (pip --target), so nothing else of the peer's shadows the worker's packages
TOOLS=build/peer-tools
if [ ! -d "$TOOLS/sentencepiece" ]; then
    "$PEER/bin/pip" install -q --target "$TOOLS" sentencepiece
fi
for t in f32 bf16; do
    out="$GGUF_DIR/base-$t.gguf"
    if [ ! -s "$out" ] || [ "$BASE/model.safetensors" -nt "$out" ]; then
        PYTHONPATH="$SRC/vendor/llama.cpp/gguf-py:$TOOLS" "$PY" "$SRC/vendor/llama.cpp/convert_hf_to_gguf.py" \
            "$BASE" --outtype "$t" --outfile "$out"
    fi
done
"$PEER/bin/python" -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__)'
ls -l "$GGUF_DIR"
