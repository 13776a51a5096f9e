#!/usr/bin/env python3
"""What ptxas gives each kernel of a kernels/cuda source: registers, spills, stack and static
shared memory per thread block, and the blocks per SM the registers allow for a block size.

Needs only nvcc (no GPU). Compiles the file for one architecture with --resource-usage, as the
build does (-O3, C++17), and demangles with c++filt.

  python3 tools/cuda-resources.py kernels/cuda/paged_attention.cu --arch sm_90 \
      [--threads 128] [--json]
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NVCC = "/usr/local/cuda/bin/nvcc"
# Per SM on sm_80 and sm_90: 64K registers, allocated per warp in units of 256.
REGISTERS_PER_SM = 65536
REGISTER_UNIT = 256
MAX_THREADS_PER_SM = {"sm_80": 2048, "sm_90": 2048}
MAX_BLOCKS_PER_SM = 32

ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+)'")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def blocks_by_registers(registers: int, threads: int, arch: str) -> int:
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    warps = -(-threads // 32)
    by_regs = REGISTERS_PER_SM // (per_warp * warps)
    return min(by_regs, MAX_THREADS_PER_SM[arch] // threads, MAX_BLOCKS_PER_SM)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("--arch", default="sm_90", choices=sorted(MAX_THREADS_PER_SM))
    ap.add_argument("--threads", type=int, default=128, help="block size for blocks per SM")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    compute = args.arch.replace("sm_", "compute_")
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run(
            [NVCC, "-O3", "-std=c++17", f"-I{ROOT}", "-isystem", "/usr/local/cuda/include",
             f"--generate-code=arch={compute},code={args.arch}", "--resource-usage", "-c",
             str(args.source), "-o", str(Path(tmp) / "out.o")],
            capture_output=True, text=True)
    if run.returncode != 0:
        sys.stderr.write(run.stdout + run.stderr)
        return 1
    kernels, current = [], None
    for line in (run.stdout + run.stderr).splitlines():
        if m := ENTRY.search(line):
            current = {"mangled": m.group(1), "arch": m.group(2)}
        elif current is not None and (m := FRAME.search(line)):
            current.update(stack_bytes=int(m.group(1)), spill_store_bytes=int(m.group(2)),
                           spill_load_bytes=int(m.group(3)))
        elif current is not None and "stack_bytes" in current and (m := USED.search(line)):
            current.update(registers=int(m.group(1)), static_smem_bytes=int(m.group(2) or 0))
            kernels.append(current)
            current = None
    names = subprocess.run(["c++filt"], input="\n".join(k["mangled"] for k in kernels),
                           capture_output=True, text=True, check=True).stdout.splitlines()
    for k, name in zip(kernels, names):
        k["kernel"] = re.sub(r"kvgrid::kernels::(cuda::\(anonymous namespace\)::)?", "", name)
        for i, d in enumerate(["fp32", "fp16", "bf16", "int8", "int4", "fp8_e4m3"]):
            k["kernel"] = k["kernel"].replace(f"(KvDType){i}", d)
        k["blocks_per_sm_by_registers"] = blocks_by_registers(k["registers"], args.threads,
                                                              args.arch)
        del k["mangled"]
    if args.json:
        print(json.dumps({"source": str(args.source), "arch": args.arch,
                          "threads": args.threads, "kernels": kernels}, indent=1))
    else:
        for k in kernels:
            print(f"{k['registers']:4d} regs  {k['spill_store_bytes']:3d} B spilled  "
                  f"{k['blocks_per_sm_by_registers']:2d} blocks/SM  {k['kernel']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
