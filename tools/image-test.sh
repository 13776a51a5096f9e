#!/usr/bin/env bash
# Builds the CPU image from deploy/docker/Dockerfile.cpu on a Debian bookworm base made here by
# debootstrap (no image registry is needed), starts a coordinator and two workers from it on a
# private podman network, and generates through them from a fourth container. A runtime
# library the Dockerfile forgets to install makes a container fail to start, and this fail.
#
# The image's build stage is the repository's own build: rather than compile everything again
# inside a container, the runtime stage's `COPY --from=build` reads the binaries this checkout
# built (build/bin) and the model, laid out at the paths the build stage would hold them
# (--build-context build=DIR), so the Dockerfile stays the one description of the image.
#
# The CUDA image cannot be built here (its bases are NVIDIA's images, from a registry): its
# build stage's packages and the runtime libraries its CUDA plugin needs (besides CUDA's own)
# are checked against the bookworm rootfs as far as that goes (check_cuda below).
#
# Usage: tools/image-test.sh [BUILD_DIR]   (default: build). Needs root, debootstrap, podman,
# runc, netavark, aardvark-dns, iptables (tools/install-deps.sh --images). The bookworm
# tarball is cached in BUILD_DIR/image-test; KVGRID_IMAGE_TEST_FRESH=1 makes a new one.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$(cd "${1:-$repo/build}" && pwd)
work="$build/image-test"
mirror=${KVGRID_DEBIAN_MIRROR:-http://deb.debian.org/debian}
dockerfile=${KVGRID_IMAGE_TEST_DOCKERFILE:-$repo/deploy/docker/Dockerfile.cpu}
net=kvgrid-image-test
tag=localhost/kvgrid:cpu-test
base=localhost/kvgrid-base:bookworm
mkdir -p "$work"

log() { echo "image-test: $*" >&2; }
fail() { echo "image-test: FAIL: $*" >&2; exit 1; }

# podman with its own storage under build/ (nothing shared with other users of this machine),
# vfs (no overlay mounts needed), runc (crun refuses a cgroup v1/v2 hybrid), and rlimits set
# low: a sandbox without CAP_SYS_RESOURCE may not raise (nor even re-set) them.
P=(podman --root "$work/storage" --runroot "$work/run" --storage-driver vfs
   --cgroup-manager cgroupfs --events-backend file --runtime runc
   --network-backend netavark --network-config-dir "$work/netconf")
nofile=4096
nproc=4096
limits=(--ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc")
mkdir -p "$work/netconf"

start=$(date +%s)

# 1. The base image: debootstrap minbase bookworm, imported.
tarball="$work/bookworm-minbase.tar"
if [[ ${KVGRID_IMAGE_TEST_FRESH:-0} == 1 || ! -s $tarball ]]; then
  log "debootstrap bookworm (minbase) from $mirror"
  rm -rf "$work/rootfs" "$tarball"
  debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log"; fail "debootstrap failed ($work/debootstrap.log)"; }
  tar -C "$work/rootfs" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
  rm -rf "$work/rootfs"
fi
"${P[@]}" import "$tarball" "$base" >/dev/null
log "base image $base imported ($(( $(date +%s) - start )) s)"

# 2. What the build stage would hold, from the Dockerfile's own COPY --from=build lines:
#    /build/X is BUILD_DIR/X, /src/X is the repository's X.
ctx="$work/context"
rm -rf "$ctx" && mkdir -p "$ctx"
copies=$(sed -e ':a' -e '/\\$/N; s/\\\n//; ta' "$dockerfile" | grep -E '^COPY --from=build ' \
  | sed -E 's/^COPY --from=build +//; s/ +[^ ]+$//')
[[ -n $copies ]] || fail "no COPY --from=build lines in $dockerfile"
for src in $copies; do
  case $src in
    /build/*) from="$build/${src#/build/}" ;;
    /src/*) from="$repo/${src#/src/}" ;;
    *) fail "COPY --from=build $src: not under /build or /src" ;;
  esac
  [[ -e $from ]] || fail "$dockerfile copies $src, but $from does not exist (build it first)"
  mkdir -p "$ctx$(dirname "$src")"
  cp -r "$from" "$ctx$src"
done

# 3. The image, FROM the imported base, runtime stage only (its apt-get install runs here).
log "building $tag from $dockerfile"
"${P[@]}" build "${limits[@]}" -f "$dockerfile" --target runtime \
  --build-arg BASE_IMAGE="$base" --build-arg RUNTIME_IMAGE="$base" \
  --build-context build="$ctx" -t "$tag" "$ctx" >"$work/build.log" 2>&1 \
  || { tail -30 "$work/build.log"; fail "podman build failed ($work/build.log)"; }
log "image built ($(( $(date +%s) - start )) s)"

# Every library the binaries need is in the image (ldd inside it names what is missing).
missing=$("${P[@]}" run --rm "${limits[@]}" --network none --entrypoint /bin/sh "$tag" -c \
  'for b in /opt/kvgrid/bin/*; do ldd "$b" | grep "not found"; done' || true)
[[ -z $missing ]] || fail "libraries missing from the image: $missing"

# 4. A cluster on a private network: coordinator, two workers, and a client container.
cleanup() {
  "${P[@]}" rm -f -t 2 kvgrid-it-coord kvgrid-it-w0 kvgrid-it-w1 >/dev/null 2>&1 || true
  "${P[@]}" network rm -f "$net" >/dev/null 2>&1 || true
}
trap cleanup EXIT
cleanup
"${P[@]}" network create "$net" >/dev/null
run=("${P[@]}" run "${limits[@]}" --network "$net" --read-only)
metrics_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"${run[@]}" -d --name kvgrid-it-coord -p "127.0.0.1:$metrics_port:9090" \
  --entrypoint kvgrid-coordinator "$tag" --listen 0.0.0.0:50051 --worker-listen 0.0.0.0:50052 \
  --health-listen 0.0.0.0:50053 --metrics-listen 0.0.0.0:9090 >/dev/null
for i in 0 1; do
  "${run[@]}" -d --name "kvgrid-it-w$i" --shm-size 256m "$tag" \
    --coordinator kvgrid-it-coord:50052 --listen 0.0.0.0:50051 \
    --advertise "kvgrid-it-w$i:50051" --group "w$i" --kv-cache-memory 64MiB --threads 1 >/dev/null
done

client=("${run[@]}" --rm --entrypoint kvgrid "$tag")
serving=0
for _ in $(seq 1 90); do
  for c in kvgrid-it-coord kvgrid-it-w0 kvgrid-it-w1; do
    state=$("${P[@]}" inspect -f '{{.State.Status}}' "$c" 2>/dev/null || echo gone)
    if [[ $state != running ]]; then
      "${P[@]}" logs "$c" 2>&1 | tail -20 >&2 || true
      fail "container $c is $state"
    fi
  done
  status=$(curl -sf "http://127.0.0.1:$metrics_port/metrics" || true)
  serving=$(awk '/^kvgrid:workers_live/ {print int($2)}' <<<"$status")
  serving=${serving:-0}
  ((serving >= 2)) && break
  sleep 1
done
((serving >= 2)) || { grep "^kvgrid:worker" <<<"$status" >&2 || true; for c in kvgrid-it-coord kvgrid-it-w0 kvgrid-it-w1; do
  "${P[@]}" logs "$c" 2>&1 | tail -10 >&2; done; fail "the two workers did not register"; }
log "cluster formed: $serving workers serving"

out=$("${client[@]}" generate --addr kvgrid-it-coord:50051 --prompt "In the beginning" \
  --max-new-tokens 8 --temperature 0 2>&1) || { echo "$out" >&2; fail "kvgrid generate failed"; }
[[ -n ${out//[[:space:]]/} ]] || fail "kvgrid generate printed nothing"
log "generated through the containers: $(head -c 200 <<<"$out" | tr '\n' ' ')"

# 5. The CUDA image, as far as this machine allows.
check_cuda() {
  local cuda="$repo/deploy/docker/Dockerfile.cuda" joined
  joined=$(sed -e ':a' -e '/\\$/N; s/\\\n//; ta' "$cuda")
  # The build stage installs what the build needs: install-deps.sh's packages, less those only
  # the tests use (GoogleTest, the CUDA emulator's Boost.Context, Python, curl, openssl).
  local installs p
  installs=" $(grep -E '^RUN .*apt-get install' <<<"$joined" | head -n 1 | tr -s ' ') "
  local test_only=" libgtest-dev libgmock-dev libboost-context-dev python3 python3-venv python3-pip curl openssl "
  for p in $(sed -n '/^packages=(/,/^)/{s/#.*//;p}' "$repo/tools/install-deps.sh" | sed '1d;$d'); do
    [[ $test_only == *" $p "* ]] && continue
    [[ $installs == *" $p "* ]] || fail "Dockerfile.cuda's build stage does not install $p"
  done
  # Its names are Debian's too (noble carries the same source packages): each is a bookworm
  # package, known to this machine's apt.
  local name
  for name in $(sed -E 's/.*--no-install-recommends//; s/&&.*//' <<<"$installs"); do
    apt-cache show --no-all-versions "$name" >/dev/null 2>&1 \
      || fail "Dockerfile.cuda's build stage installs $name, which bookworm does not have"
  done
  # The plugin is built and copied beside kvgrid-worker, where --device cuda looks for it.
  grep -E '^RUN .*--target .*kvgrid_cuda_plugin' <<<"$joined" >/dev/null \
    || fail "Dockerfile.cuda does not build kvgrid_cuda_plugin"
  grep -E '^COPY --from=build .*/libkvgrid_cuda_plugin\.so .*/opt/kvgrid/bin/' <<<"$joined" \
    >/dev/null || fail "Dockerfile.cuda does not copy libkvgrid_cuda_plugin.so to /opt/kvgrid/bin"
  # The libraries the plugin links, other than CUDA's own (the NVIDIA runtime image brings
  # those), resolve in the CPU image, whose packages the CUDA runtime stage names in noble's
  # spelling (t64). That noble has those names is not checked: no Ubuntu archive is reachable.
  local plugin="$build/bin/libkvgrid_cuda_plugin.so"
  if [[ -f $plugin ]]; then
    "${P[@]}" run --rm "${limits[@]}" --network none -v "$plugin:/tmp/plugin.so:ro" \
      --entrypoint /bin/sh "$tag" -c 'ldd /tmp/plugin.so' >"$work/plugin-ldd.txt" 2>&1 || true
    missing=$(grep "not found" "$work/plugin-ldd.txt" \
      | grep -vE 'lib(cuda|cudart|cublas|cublasLt|nccl|nvrtc|nvJitLink)\.so' || true)
    [[ -z $missing ]] || fail "the CUDA plugin needs libraries no runtime package gives: $missing"
    log "CUDA plugin: non-CUDA libraries present; CUDA's from the NVIDIA image:" \
      "$(grep 'not found' "$work/plugin-ldd.txt" | awk '{print $1}' | tr '\n' ' ')"
  else
    log "CUDA plugin not built here ($plugin): its libraries are not checked"
  fi
}
check_cuda

log "PASS in $(( $(date +%s) - start )) s"
