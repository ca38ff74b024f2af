#!/usr/bin/env bash
# Build llama.cpp's llama-server once, from the sources the llama-cpp-python source
# distribution on PyPI ships (vendor/llama.cpp), into a cache folder shared by every clone:
#
#   $ENVLOOP_LLAMA_DIR (default ~/.cache/envloop/llama.cpp-<version>)/
#       src/            the extracted llama.cpp sources (convert_hf_to_gguf.py, gguf-py)
#       bin/llama-server
#
# Prints the cache folder. A finished build is reused (the build writes bin/ last), so this
# takes about a second once cached and 15-25 minutes the first time on a 2-core machine.
#
#   scripts/build_llama_server.sh [PYTHON]    # PYTHON: the venv's python (for pip download)
set -euo pipefail

version=0.3.36
python=${1:-.venv/bin/python}
cache=${ENVLOOP_LLAMA_DIR:-$HOME/.cache/envloop/llama.cpp-$version}

if [ -x "$cache/bin/llama-server" ]; then
    echo "$cache"
    exit 0
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/envloop-llama.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "building llama-server $version into $cache (15-25 minutes on 2 cores, once)" >&2
"$python" -m pip download --quiet --no-deps --no-binary :all: \
    "llama-cpp-python==$version" -d "$work" >&2
tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
mkdir -p "$cache"
rm -rf "$cache/src"
mv "$work/llama_cpp_python-$version/vendor/llama.cpp" "$cache/src"
cmake -S "$cache/src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$work/build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$cache/bin.partial"
cp "$work/build/bin/llama-server" "$cache/bin.partial/"  # static: no libraries beside it
rm -rf "$cache/bin"
mv "$cache/bin.partial" "$cache/bin"
echo "$cache"
