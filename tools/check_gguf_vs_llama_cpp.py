#!/usr/bin/env python3
"""Checks kvgrid's forward pass on GGUF files against llama.cpp's own (llama-cpp-python), on
the tiny fixture models exported by tools/export_gguf.py: qwen3-tiny (qwen3: attn_q_norm /
attn_k_norm, head_dim from key_length), llama-yarn-tiny (rope.scaling.* yarn keys) and
llama3-tiny (Llama 3.1 scaling as rope_freqs.weight), plus qwen2-tiny.

Not part of CI: it needs llama-cpp-python, which the project does not depend on (its sdist
builds llama.cpp, minutes on two cores). Run it from an environment that has it, numpy and gguf:

    python3 tools/make_tiny_model.py --all --out /tmp/fixtures
    CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF" \\
        /path/to/venv/bin/pip install llama-cpp-python gguf
    /path/to/venv/bin/python3 tools/check_gguf_vs_llama_cpp.py --fixtures /tmp/fixtures \\
        --kvgrid build/bin/kvgrid

With --llama-cpp-dir (a llama.cpp source tree) the GGUF files come from llama.cpp's own
converter, convert_hf_to_gguf.py (which needs torch, transformers and sentencepiece besides),
instead of tools/export_gguf.py.

Both sides run fp32 weights and an fp32 KV cache (llama.cpp's type_k/type_v F32, no flash
attention); for every model and prompt of numpy_llama.CASES it prints the largest absolute
difference of the last position's logits and whether the top-1 tokens agree, and exits
non-zero when a difference exceeds --tol or a top-1 differs.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import llama_cpp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "reference"))
import numpy_llama  # noqa: E402

MODELS = ["qwen3-tiny", "llama-yarn-tiny", "llama3-tiny", "qwen2-tiny"]
GGML_TYPE_F32 = 0


def kvgrid_logits(exe, path, ids):
    out = subprocess.run([str(exe), "logits", "--model", str(path), "--prompt-ids",
                          ",".join(str(t) for t in ids), "--kv-cache-dtype", "fp32"],
                         capture_output=True, text=True, check=True)
    return np.asarray(json.loads(out.stdout)["logits"], dtype=np.float64)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixtures", required=True, help="directory with the fixture models")
    ap.add_argument("--kvgrid", default=str(ROOT / "build" / "bin" / "kvgrid"))
    ap.add_argument("--tol", type=float, default=2e-4)
    ap.add_argument("--llama-cpp-dir", help="convert with this tree's convert_hf_to_gguf.py")
    args = ap.parse_args()
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            d = Path(args.fixtures) / name
            path = Path(tmp) / f"{name}.gguf"
            if args.llama_cpp_dir:
                src = Path(args.llama_cpp_dir)
                subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(d),
                                "--outfile", str(path), "--outtype", "f32"], check=True,
                               env={**os.environ, "PYTHONPATH": str(src / "gguf-py")},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            else:
                subprocess.run([sys.executable, str(ROOT / "tools" / "export_gguf.py"),
                                "--model", str(d), "--out", str(path), "--type", "f32"],
                               check=True)
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=256,
                                  logits_all=True, n_threads=2, verbose=False,
                                  type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, flash_attn=False)
            print(f"\n{name}")
            for case, plen, dlen in numpy_llama.CASES:
                prompt, dec = numpy_llama.case_ids(d, case, plen, dlen)
                ids = prompt + dec
                llm.reset()
                llm.eval(ids)
                want = np.asarray(llm.scores[len(ids) - 1], dtype=np.float64)
                got = kvgrid_logits(args.kvgrid, path, ids)
                diff = float(np.max(np.abs(got - want)))
                same = int(np.argmax(got)) == int(np.argmax(want))
                print(f"  {case:8s} logits max|diff| {diff:.2e} (max |logit| "
                      f"{np.max(np.abs(want)):.1f})  top-1 {'equal' if same else 'DIFFERENT'}")
                ok &= diff <= args.tol and same
            del llm
    print("\nOK" if ok else "\nMISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
