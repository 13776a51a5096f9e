#!/usr/bin/env bash
# Installs the Debian packages kvgrid builds and tests with (Debian bookworm).
# Idempotent: does nothing when every package is already installed.
set -euo pipefail

packages=(
  build-essential cmake pkg-config git
  libabsl-dev libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libgtest-dev libgmock-dev libcivetweb-dev libgloo-dev libopenblas-openmp-dev libpcre2-dev libicu-dev nlohmann-json3-dev
  libboost-context-dev libboost-dev libssl-dev curl
  # the TLS tests make their certificates with the openssl command
  openssl
  python3 python3-venv python3-pip
)
# --images: what tools/image-test.sh builds and starts the container images with.
if [[ ${1:-} == --images ]]; then
  packages+=(debootstrap podman runc netavark aardvark-dns iptables)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
