#!/usr/bin/env bash
# Build llama.cpp's `llama-server` once, from the llama.cpp source that the llama-cpp-python
# sdist vendors (PyPI is the only source registry this project reaches), and print its path.
#
#   bench/build_llama_server.sh            # prints e.g. ~/.cache/prefixd/llama-server/bin/llama-server
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 bench/build_llama_server.sh
#
# Idempotent: an existing binary is printed without rebuilding (delete the folder to rebuild).
# Resumable: an interrupted build continues where it stopped (source and build folders are
# kept under the cache folder until the binary is in place). Needs cmake, ninja and a C++
# compiler (`apt-get install cmake ninja-build g++`). Takes 10-20 minutes on 2 free cores;
# runs under `nice -n 19`. Progress goes to stderr, the path to stdout.
set -euo pipefail
CACHE="${PREFIXD_CACHE_DIR:-$HOME/.cache/prefixd}"
CACHE="${CACHE/#\~/$HOME}"
OUT="$CACHE/llama-server"
BIN="$OUT/bin/llama-server"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi

for tool in cmake ninja g++; do
  command -v "$tool" >/dev/null || { echo "build_llama_server: $tool missing: apt-get install cmake ninja-build g++" >&2; exit 2; }
done
PY="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock 9
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi  # another run built it while we waited

SRC="$OUT/src"
if [ ! -f "$SRC/SOURCE" ]; then
  rm -rf "$SRC" "$OUT/build" "$OUT"/.src.*
  tmp="$(mktemp -d "$OUT/.src.XXXXXX")"
  spec="llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}"
  echo "build_llama_server: downloading the $spec sdist ..." >&2
  # The sdist only (--no-binary for this package; its build backend may come as a wheel, so
  # pip's metadata step does not build setuptools & co. from source first).
  "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python -d "$tmp/dl" "$spec" >&2
  sdist="$(ls "$tmp"/dl/llama_cpp_python-*.tar.gz | head -1)"
  tar -xzf "$sdist" -C "$tmp"
  mv "$(ls -d "$tmp"/llama_cpp_python-*/vendor/llama.cpp | head -1)" "$tmp/llama.cpp"
  basename "$sdist" > "$tmp/llama.cpp/SOURCE"
  mv "$tmp/llama.cpp" "$SRC"
  rm -rf "$tmp"
fi
echo "build_llama_server: building llama-server from $(cat "$SRC/SOURCE") with $JOBS jobs ..." >&2
if [ ! -f "$OUT/build/build.ninja" ]; then
  nice -n 19 cmake -S "$SRC" -B "$OUT/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF >&2
fi
nice -n 19 cmake --build "$OUT/build" --target llama-server -j "$JOBS" >&2
mkdir -p "$OUT/bin"
cp "$OUT/build/bin/llama-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
cp "$SRC/SOURCE" "$OUT/SOURCE"
rm -rf "$SRC" "$OUT/build"
echo "$BIN"
