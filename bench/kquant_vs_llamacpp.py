#!/usr/bin/env python3
"""kvgrid against llama.cpp on the same GGUF files: held-out perplexity and batch-1 decode
speed, side by side in one run.

The trained model (models/kjv-tiny) is exported to an F32 GGUF by tools/export_gguf.py and
quantized by llama.cpp's own llama-quantize to each --ftypes entry; then for every file, one
after the other:
  llama-perplexity -c CTX -t THREADS          (its "Final estimate: PPL")
  build/bin/gguf_quant_bench --ctx CTX        (the same protocol in kvgrid; see that program)
  llama-bench -p 0 -n TOKENS -t THREADS       (tg: decode tokens/s)
  gguf_quant_bench --decode-tokens TOKENS     (kvgrid decode tokens/s, best of its repeats)

llama.cpp is not part of this repository: build llama-quantize, llama-perplexity and
llama-bench yourself (cmake -DGGML_NATIVE=ON -DLLAMA_CURL=OFF) and pass --llama-bin.

  bench/kquant_vs_llamacpp.py --llama-bin /tmp/llama-build/bin [--build build]
      [--ftypes Q4_K_M,Q5_K_M,Q6_K] [--threads 2] [--ctx 512] [--json]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "kjv-tiny"
HELDOUT = MODEL / "heldout.txt"


def run(cmd, env=None):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed:\n{r.stderr[-2000:]}")
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-bin", required=True, type=Path)
    ap.add_argument("--build", default=ROOT / "build", type=Path)
    ap.add_argument("--ftypes", default="Q4_K_M,Q5_K_M,Q6_K,Q3_K_M,Q2_K,IQ4_NL,Q5_0,Q5_1")
    ap.add_argument("--threads", default=2, type=int)
    ap.add_argument("--ctx", default=512, type=int)
    ap.add_argument("--decode-tokens", default=64, type=int)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    bench = args.build / "bin" / "gguf_quant_bench"
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    rows = []
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        f32 = d / "kjv-tiny-f32.gguf"
        run([sys.executable, ROOT / "tools" / "export_gguf.py", "--model", MODEL, "--out", f32,
             "--type", "f32"])
        files = [("F32", f32)]
        for ftype in args.ftypes.split(","):
            out = d / f"kjv-tiny-{ftype}.gguf"
            run([args.llama_bin / "llama-quantize", f32, out, ftype])
            files.append((ftype, out))
        for ftype, path in files:
            r = run([args.llama_bin / "llama-perplexity", "-m", path, "-f", HELDOUT, "-c",
                     args.ctx, "-t", args.threads])
            m = re.search(r"Final estimate: PPL = ([0-9.]+)", r.stdout + r.stderr)
            llama_ppl = float(m.group(1))
            ours = json.loads(run([bench, "--model", path, "--text-file", HELDOUT, "--ctx",
                                   args.ctx, "--decode-tokens", args.decode_tokens,
                                   "--repeats", 5, "--json"], env=env).stdout)
            tg = json.loads(run([args.llama_bin / "llama-bench", "-m", path, "-p", 0, "-n",
                                 args.decode_tokens, "-t", args.threads, "-r", 5, "-o",
                                 "json"]).stdout)
            llama_tps = tg[0]["avg_ts"]
            ppl = ours["perplexity"]["ppl"]
            rows.append({
                "ftype": ftype, "file_bytes": path.stat().st_size,
                "tensor_types": ours["tensor_types"],
                "ppl_kvgrid": ppl, "ppl_llama_cpp": llama_ppl,
                "ppl_rel_diff": (ppl - llama_ppl) / llama_ppl,
                "decode_tps_kvgrid": ours["decode"]["tokens_per_s"],
                "decode_tps_llama_cpp": llama_tps,
                "decode_ratio": ours["decode"]["tokens_per_s"] / llama_tps,
                "gemv_4096_us": {g["type"]: g["us"] for g in ours["gemv_4096"]},
            })
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print("| file | tensor types | PPL kvgrid | PPL llama.cpp | diff | decode tok/s kvgrid | "
          "llama.cpp | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        types = ", ".join(f"{k} {v}" for k, v in sorted(r["tensor_types"].items()))
        print(f"| {r['ftype']} | {types} | {r['ppl_kvgrid']:.4f} | {r['ppl_llama_cpp']:.4f} | "
              f"{100 * r['ppl_rel_diff']:+.3f}% | {r['decode_tps_kvgrid']:.0f} | "
              f"{r['decode_tps_llama_cpp']:.0f} | {r['decode_ratio']:.2f} |")


if __name__ == "__main__":
    main()
