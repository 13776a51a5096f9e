#!/usr/bin/env bash
# Builds the CUDA kernels' gpu-labelled tests, the CUDA benchmarks, the serving binaries
# (kvgrid, kvgrid-coordinator, kvgrid-worker and its CUDA plugin) and serve_bench here and
# packs them into .gpu-bundle/kvgrid-gpu.tar.xz for tools/gpu-check.sh, with every shared
# library they load (glibc's loader included) except the GPU driver's, cuBLAS and NCCL, which
# the GPU machine's CUDA 13 packages provide. The GPU machine has no package registry and none
# of kvgrid's build dependencies, so kvgrid is built here and the archive travels (it must stay
# under 60 MiB).
# kvgrid's own libraries are built shared here, so that the device code is packed once, not
# once per program.
#
#   bash tools/gpu-bundle.sh            # then run tools/gpu-check.sh there with .gpu-bundle
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$root/build-gpu"
bundle="$build/bundle"  # staging; the archive goes to .gpu-bundle/
jobs="${KVGRID_JOBS:-$(nproc)}"

# The H200 is sm_90; one architecture keeps the build short.
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVGRID_CUDA=ON -DBUILD_SHARED_LIBS=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${KVGRID_GPU_ARCH:-90}" >/dev/null
mapfile -t targets < <(cmake --build "$build" --target help | sed -n 's/^\.\.\. \(gpu_[a-z0-9_]*\|cuda_[a-z0-9_]*bench\)$/\1/p')
if [[ ${#targets[@]} -eq 0 ]]; then
  echo "gpu-bundle: no gpu_* tests or cuda_*bench targets (is CUDA found?)" >&2
  exit 1
fi
servers=(kvgrid kvgrid-coordinator kvgrid-worker serve_bench kvgrid_cuda_plugin)
cmake --build "$build" -j "$jobs" --target "${targets[@]}" "${servers[@]}"

rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/lib"
# Every resolved library of $1 but the driver's (libcuda, libnvidia-*), cuBLAS and NCCL
# (hundreds of MB; the GPU machine's Python packages carry CUDA 13's).
pack_libs() {
  ldd "$1" | awk '/=> \// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libcuda.so*|libnvidia-*|libcublas*|libnccl*) ;;
      *) cp -Ln "$lib" "$bundle/lib/" 2>/dev/null || true ;;
    esac
  done
}
for t in "${targets[@]}" kvgrid kvgrid-coordinator kvgrid-worker serve_bench; do
  exe="$(find "$build" -type f -name "$t" -perm -u+x | head -n 1)"
  [[ -n "$exe" ]] || { echo "gpu-bundle: $t was not built" >&2; exit 1; }
  cp "$exe" "$bundle/bin/"
  pack_libs "$exe"
done
plugin="$build/bin/libkvgrid_cuda_plugin.so"
[[ -f "$plugin" ]] || { echo "gpu-bundle: the CUDA plugin was not built" >&2; exit 1; }
cp "$plugin" "$bundle/lib/"
pack_libs "$plugin"
cp -L /lib64/ld-linux-x86-64.so.2 "$bundle/lib/"
rm -rf "$root/.gpu-bundle" && mkdir -p "$root/.gpu-bundle"
archive="$root/.gpu-bundle/kvgrid-gpu.tar.xz"
tar -C "$bundle" -cJf "$archive" bin lib
size_kib=$(du -sk "$archive" | cut -f1)
echo "gpu-bundle: ${#targets[@]} tests and benchmarks, 3 serving programs, serve_bench and the" \
  "CUDA plugin," \
  "$((size_kib / 1024)) MiB in $archive"
if (( size_kib > 60 * 1024 )); then
  echo "gpu-bundle: larger than 60 MiB; the device tool carries at most 64 MiB" >&2
  exit 1
fi
