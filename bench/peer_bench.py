#!/usr/bin/env python3
"""kvgrid against llama.cpp on the same GGUF files, side by side: prefill, decode at two
depths and batched decode, as medians of paired ratios kvgrid / llama.cpp.

What it does, all under --work (default ~/.cache/kvgrid-peer; reused between runs):

1. llama.cpp: the source that the llama-cpp-python sdist carries (vendor/llama.cpp), pinned
   by --llama-cpp-python, fetched with `pip download --no-binary :all: --no-deps` and built
   out of tree with cmake -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF, targets
   llama-bench, llama-batched-bench and llama-quantize only. Nothing of it enters this
   repository. When it cannot be had (no network, no compiler) the run is skipped, exit 0.
2. Models: a random-weight checkpoint of Qwen2-0.5B's shape (bench/bench_models.h; --layers
   for a smaller one) from tools/make_tiny_model.py's generator with the real Qwen2 tokenizer,
   exported by tools/export_gguf.py as F32, F16, BF16, Q8_0 and Q4_0, those of them its --type
   has ("kvgrid-*": the exporter's layout; its Q8_0/Q4_0 keep token_embd in F32), and
   quantized by llama-quantize from the F32 file to F16, BF16, Q8_0 and Q4_0 ("llama-*":
   llama.cpp's layout, token_embd quantized too).
3. For every file and figure, --pairs pairs of runs, kvgrid and llama.cpp one after the other
   (the order alternating pair by pair, so drift in the machine's load does not favour one):
     ppN      prefill of N tokens        kvgrid run --prompt-ids (N) --max-new-tokens 1
                                         llama-bench -p N -n 0 -r 1
     tg64@dD  64 decoded tokens, depth D  kvgrid run --prompt-ids (max(D, 1)) --max-new-tokens 65
                                         (the first token comes from the prefill)
                                         llama-bench -p 0 -n 64 -d D -r 1
     bB       batched decode, B sequences kvgrid run --prompts-file (B prompts of 128 tokens)
              of 128-token prompts        llama-batched-bench -npp 128 -ntg 64 -npl B: S_TG,
                                         against kvgrid's decode_tokens_per_s over the batch
   kvgrid's figures are its `run --json` timings (timed around the engine, model load
   excluded); llama.cpp's are its tools' own (llama-bench runs one warm-up pass before each
   measured one; kvgrid's process runs cold). Both use --threads threads and F16 K/V:
   llama.cpp's default cache type, kvgrid's --kv-cache-dtype fp16 (--kv-cache-dtype changes
   kvgrid's). llama.cpp's flash attention is left at its default (auto) and recorded.
4. For each batched figure, each engine's median over its own batch-1 decode at depth 0
   (tg64@d0 of the same file and run): how far batching multiplies its throughput.
5. The machine's memory bandwidth (a numpy "add" over 3 x 256 MiB arrays, --threads threads;
   the same bytes as STREAM's triad) before and after, and for batch-1 decode each engine's
   fraction of the roofline: bandwidth / bytes a step reads (the file's tensor bytes, less the
   embedding table when the head is a separate tensor, since the lookup reads one row; plus
   the F16 K/V of the context).

  bench/peer_bench.py [--json] [--pairs 5] [--threads 2] [--layers 24] [--files a,b]
  bench/peer_bench.py --quick            # 2 layers, 2 pairs, the two Q8_0 files: a smoke test
  bench/peer_bench.py --prepare-only     # build llama.cpp and write the files, measure nothing
"""

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
LLAMA_TOOLS = ["llama-bench", "llama-batched-bench", "llama-quantize"]
# The version tools/check_gguf_vs_llama_cpp.py and bench/kquant_vs_llamacpp.py were run with.
LLAMA_CPP_PYTHON = "0.3.36"
# The exporter's types, of those it has (export_gguf.TYPES); F32 is the source of the rest.
EXPORT_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0"]
LLAMA_FILES = {"llama-f16": "F16", "llama-bf16": "BF16", "llama-q8_0": "Q8_0",
               "llama-q4_0": "Q4_0"}
# Qwen2-0.5B (bench/bench_models.h Qwen2HalfBConfig).
SHAPE = {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
         "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
         "head_dim": 64, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
         "rope_theta": 1000000.0}
# Words that the Qwen2 tokenizer keeps as one token each, with or without a leading space:
# a batch prompt is one of them repeated, so its length is exact (checked against kvgrid's
# count) and the prompts of a batch (up to 24) differ. Prefix caching is off for the batch
# anyway, as llama-batched-bench's sequences share nothing.
BATCH_WORDS = ["the", "and", "of", "to", "in", "is", "it", "that", "for", "on", "with", "as",
               "was", "at", "by", "be", "this", "from", "or", "an", "but", "not", "are", "his"]


class Skip(Exception):
    """llama.cpp cannot be had here; the run is skipped, not failed."""


def log(msg):
    print(f"peer_bench: {msg}", file=sys.stderr, flush=True)


class Failed(RuntimeError):
    """A command exited non-zero; returncode < 0 is the signal that ended it."""

    def __init__(self, message, returncode):
        super().__init__(message)
        self.returncode = returncode


def run(cmd, env=None, timeout=7200, cwd=None):
    """Runs `cmd`; returns the CompletedProcess, raising Failed with the tail of stderr on
    failure."""
    cmd = [str(c) for c in cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
    if r.returncode != 0:
        raise Failed(f"{' '.join(cmd)} exited {r.returncode}:\n"
                     f"{(r.stderr or r.stdout)[-3000:]}", r.returncode)
    return r


# ---------------------------------------------------------------------------------- llama.cpp

def llama_cpp_tools(work, version, jobs):
    """Builds (or finds, already built) llama.cpp's tools; returns (bin dir, source info)."""
    base = work / f"llama-cpp-python-{version}"
    src, build = base / "llama.cpp", base / "build"
    bindir = build / "bin"
    info_path = base / "source.json"
    if all((bindir / t).is_file() for t in LLAMA_TOOLS) and info_path.is_file():
        return bindir, json.loads(info_path.read_text())
    base.mkdir(parents=True, exist_ok=True)
    if not (src / "CMakeLists.txt").is_file():
        dl = base / "sdist"
        dl.mkdir(exist_ok=True)
        sdist = dl / f"llama_cpp_python-{version}.tar.gz"
        if not sdist.is_file():
            log(f"downloading the llama-cpp-python {version} sdist (its vendor/llama.cpp)")
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:",
                                "--no-deps", f"llama-cpp-python=={version}", "-d", str(dl)],
                               capture_output=True, text=True)
            if r.returncode != 0 or not sdist.is_file():
                raise Skip(f"pip download llama-cpp-python=={version} failed: "
                           f"{(r.stderr or r.stdout).strip()[-500:]}")
        extract_vendor(sdist, src, version)
    for tool_dir in ("tools/llama-bench", "tools/batched-bench", "tools/quantize"):
        if not (src / tool_dir / "CMakeLists.txt").is_file():
            raise Skip(f"the llama-cpp-python {version} sdist has no vendor/llama.cpp/{tool_dir}")
    info = {"source": f"llama-cpp-python=={version} sdist, vendor/llama.cpp",
            "commit": (base / "commit").read_text().strip() if (base / "commit").is_file()
            else "unknown"}
    if shutil.which("cmake") is None:
        raise Skip("cmake is not installed")
    log(f"building {', '.join(LLAMA_TOOLS)} in {build} (minutes)")
    cfg = ["cmake", "-S", src, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
           "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF",
           "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
           "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_TOOLS=ON"]
    if info["commit"] != "unknown":
        # The tree has no .git; this makes llama-bench report the commit it was built from.
        cfg.append(f"-DLLAMA_BUILD_COMMIT={info['commit'][:10]}")
    try:
        run(cfg)
        run(["cmake", "--build", build, "-j", jobs, "--target", *LLAMA_TOOLS])
    except (RuntimeError, OSError) as e:
        raise Skip(f"building llama.cpp failed: {e}")
    info_path.write_text(json.dumps(info) + "\n")
    return bindir, info


def extract_vendor(sdist, dest, version):
    """Extracts only vendor/llama.cpp of the sdist into `dest`, and the commit the sdist's git
    metadata records for that submodule (the sdist carries its .git) into dest/../commit."""
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    tmp = Path(tempfile.mkdtemp(prefix=".llama.cpp.", dir=dest.parent))
    try:
        with tarfile.open(sdist) as tf:
            members = [m for m in tf.getmembers()
                       if m.name.startswith(prefix) or
                       m.name.startswith(f"llama_cpp_python-{version}/.git")]
            tf.extractall(tmp, members=members, filter="data")
        root = tmp / f"llama_cpp_python-{version}"
        r = subprocess.run(["git", "-C", str(root), "ls-tree", "HEAD", "vendor/llama.cpp"],
                           capture_output=True, text=True)
        fields = r.stdout.split()
        if r.returncode == 0 and len(fields) >= 3 and fields[1] == "commit":
            (dest.parent / "commit").write_text(fields[2] + "\n")
        vendor = root / "vendor" / "llama.cpp"
        # Its .git file points into the sdist's .git, which is not kept: without it llama.cpp's
        # cmake finds no repository and says so once, instead of failing git calls.
        if (vendor / ".git").is_file():
            (vendor / ".git").unlink()
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(vendor, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------ models

def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def kvgrid_files():
    """{file name: export_gguf.py --type} for the types the exporter has."""
    types = load_tool("export_gguf").TYPES
    return {f"kvgrid-{t}": t for t in EXPORT_TYPES if t in types}


def make_models(work, layers, names, llama_bin, llama_version):
    """Writes the GGUF files `names` (kvgrid-* and llama-*) for a model of `layers` layers;
    returns {name: path}. Files already written by the same generator, exporter and
    llama.cpp are reused; those of an older generator or exporter are removed."""
    mtm = load_tool("make_tiny_model")
    preset = dict(mtm.PRESETS["qwen2-tiny"])
    preset.update(SHAPE, num_hidden_layers=layers, dtype="float32", seed=0,
                  gain={"embed": 1.0, "proj": 1.0, "head": 1.0, "bias": 0.1, "norm_noise": 0.1})
    # The checkpoint depends on the generator only, the GGUF files on the exporter and
    # llama.cpp too: an edit to the exporter re-exports without drawing the weights again.
    h_hf = hashlib.sha256(json.dumps(preset, sort_keys=True).encode())
    h_hf.update((ROOT / "tools" / "make_tiny_model.py").read_bytes())
    h_gguf = h_hf.copy()
    h_gguf.update((ROOT / "tools" / "export_gguf.py").read_bytes())
    h_gguf.update(llama_version.encode())
    models = work / "models"
    hf = models / f"qwen2-0.5b-shape-{layers}L-hf-{h_hf.hexdigest()[:12]}"
    d = models / f"qwen2-0.5b-shape-{layers}L-gguf-{h_gguf.hexdigest()[:12]}"
    d.mkdir(parents=True, exist_ok=True)
    for kind, keep in (("hf", hf), ("gguf", d)):
        for old in models.glob(f"qwen2-0.5b-shape-{layers}L-{kind}-*"):
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)
    exported = kvgrid_files()
    paths = {n: d / f"{n}.gguf" for n in names}
    need_f32 = any(n in LLAMA_FILES for n in names)
    todo_export = [n for n in exported
                   if (n in names or (n == "kvgrid-f32" and need_f32))
                   and not (d / f"{n}.gguf").is_file()]
    if todo_export and not (hf / "model.safetensors").is_file():
        log(f"generating random weights ({layers} layers) in {hf}")
        tok_dir = mtm.find_tokenizer_dir(preset["tokenizer"])
        tmp = Path(tempfile.mkdtemp(prefix=".hf.", dir=models))
        (tmp / "config.json").write_text(json.dumps(mtm.hf_config(preset), indent=2) + "\n")
        (tmp / "generation_config.json").write_text(
            json.dumps(mtm.generation_config(preset), indent=2) + "\n")
        for fname in ("tokenizer.json", "tokenizer_config.json"):
            if (tok_dir / fname).is_file():
                shutil.copyfile(tok_dir / fname, tmp / fname)
        mtm.save_safetensors(mtm.make_weights(preset, mtm.tokenizer_size(tok_dir)), "float32",
                             tmp / "model.safetensors")
        if hf.exists():
            shutil.rmtree(hf)
        os.rename(tmp, hf)
    for n in todo_export:
        log(f"exporting {n}.gguf (tools/export_gguf.py --type {exported[n]})")
        tmp = d / f".{n}.gguf"
        run([sys.executable, ROOT / "tools" / "export_gguf.py", "--model", hf, "--out", tmp,
             "--type", exported[n]])
        os.rename(tmp, d / f"{n}.gguf")
    for n in names:
        if n in LLAMA_FILES and not paths[n].is_file():
            log(f"quantizing {n}.gguf (llama-quantize kvgrid-f32.gguf {LLAMA_FILES[n]})")
            tmp = d / f".{n}.gguf"
            run([llama_bin / "llama-quantize", d / "kvgrid-f32.gguf", tmp, LLAMA_FILES[n]])
            os.rename(tmp, paths[n])
    return paths


def file_layout(path):
    """Tensor types, bytes, and what one batch-1 decode step reads of the weights."""
    import gguf
    r = gguf.GGUFReader(str(path))
    types, total, embd, embd_type = {}, 0, 0, None
    names = set()
    for t in r.tensors:
        name = t.tensor_type.name
        types[name] = types.get(name, 0) + 1
        total += int(t.n_bytes)
        names.add(t.name)
        if t.name == "token_embd.weight":
            embd, embd_type = int(t.n_bytes), name
    tied = "output.weight" not in names
    return {"file_bytes": path.stat().st_size, "tensor_bytes": total, "tensor_types": types,
            "token_embd_type": embd_type, "tied_head": tied,
            # A tied head reads the whole table every step; a separate one leaves the
            # embedding to one looked-up row.
            "decode_weight_bytes": total if tied else total - embd}


# -------------------------------------------------------------------------------- bandwidth

def bandwidth_gbs(threads, repeats=5):
    """STREAM-style: a = b + c over 256 MiB arrays (two reads, one write counted), split over
    `threads` threads (numpy releases the GIL inside the loop); best of `repeats`."""
    n = 64 << 20
    a = np.zeros(n, np.float32)
    b = np.ones(n, np.float32)
    c = np.full(n, 2.0, np.float32)
    bounds = np.linspace(0, n, threads + 1).astype(np.int64)

    def part(i):
        lo, hi = bounds[i], bounds[i + 1]
        np.add(b[lo:hi], c[lo:hi], out=a[lo:hi])

    best = 0.0
    for _ in range(repeats):
        ts = [threading.Thread(target=part, args=(i,)) for i in range(threads)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = max(best, 3 * 4 * n / (time.perf_counter() - t0))
    assert a[n // 2] == 3.0
    return best / 1e9


# ------------------------------------------------------------------------------------ engines

class Kvgrid:
    def __init__(self, exe, threads, kv_dtype):
        self.exe, self.threads, self.kv_dtype = exe, threads, kv_dtype
        self.env = dict(os.environ, OMP_NUM_THREADS=str(threads))

    def _run(self, model, *args):
        r = run([self.exe, "run", "--model", model, "--threads", self.threads,
                 "--kv-cache-dtype", self.kv_dtype, "--temperature", 0, "--ignore-eos",
                 "--json", *args], env=self.env)
        return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]

    def prefill(self, model, ids):
        t = self._run(model, "--prompt-ids", ",".join(map(str, ids)),
                      "--max-new-tokens", 1)[0]["timings"]
        assert t["prompt_tokens"] == len(ids) and t["cached_prompt_tokens"] == 0, t
        return t["prefill_tokens_per_s"], t

    def decode(self, model, ids, n):
        # One more token than measured: the first comes out of the prefill.
        t = self._run(model, "--prompt-ids", ",".join(map(str, ids)),
                      "--max-new-tokens", n + 1)[0]["timings"]
        assert t["decode_tokens"] == n, t
        return t["decode_tokens_per_s"], t

    def batched(self, model, prompts_file, batch, prompt_len, n):
        lines = self._run(model, "--prompts-file", prompts_file, "--max-new-tokens", n + 1,
                          "--enable-prefix-caching", "false", "--max-num-seqs", max(batch, 1))
        t = lines[-1]["timings"]
        lens = [line["prompt_tokens"] for line in lines[:-1]]
        assert lens == [prompt_len] * batch, f"batch prompts tokenized to {lens}"
        return t["decode_tokens_per_s"], t


class LlamaCpp:
    """llama.cpp's own tools, with their defaults (weight repacking on). Where a run with
    repacking dies of a signal (llama.cpp 0c1e57098b's AMX matrix product does, at batches above
    one, on Sapphire Rapids-class CPUs whose AMX it detects), that kind of figure is measured
    with repacking off (llama-bench --repack 0, llama-batched-bench --no-repack) and the
    fallback is recorded in `fallbacks`, so the table says which llama.cpp it compares with."""

    def __init__(self, bindir, threads):
        self.bindir, self.threads = bindir, threads
        self.env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        self.settings = None  # what llama-bench reports it ran with (first run)
        self.no_repack = set()  # (model, kind) measured with repacking off
        self.fallbacks = []     # why, as text

    def _with_fallback(self, model, kind, cmd, off_flags):
        """Runs cmd; on death by a signal with repacking on, again with `off_flags`."""
        key = (str(model), kind)
        if key in self.no_repack:
            return run([*cmd, *off_flags], env=self.env), False
        try:
            return run(cmd, env=self.env), True
        except Failed as e:
            if e.returncode >= 0:
                raise
            self.no_repack.add(key)
            self.fallbacks.append(f"{Path(model).stem} {kind}: llama.cpp died of signal "
                                  f"{-e.returncode} with weight repacking on; measured with "
                                  f"{' '.join(map(str, off_flags))}")
            log(self.fallbacks[-1])
            return run([*cmd, *off_flags], env=self.env), False

    def _bench(self, model, kind, *args):
        r, repacked = self._with_fallback(
            model, kind, [self.bindir / "llama-bench", "-m", model, "-t", self.threads, "-r", 1,
                          "-ctk", "f16", "-ctv", "f16", "-o", "json", *args], ["--repack", 0])
        res = json.loads(r.stdout)[0]
        res["weights_repacked"] = repacked
        if self.settings is None:
            self.settings = {k: res.get(k) for k in (
                "build_commit", "build_number", "cpu_info", "backends", "type_k", "type_v",
                "flash_attn", "n_batch", "n_ubatch", "n_threads", "use_mmap", "repack",
                "no_kv_offload") if k in res}
        return res

    def probe(self, model):
        """What llama.cpp resolves for this file: flash attention (auto), the K/V types, and
        the weights it repacks (CPU_REPACK) or reads where mapped. From its own log."""
        # One-token steps only: what this reads must not depend on the batch paths.
        r = run([self.bindir / "llama-batched-bench", "-m", model, "-c", 256, "-npp", 1,
                 "-ntg", 1, "-npl", 1, "-t", self.threads, "-tb", self.threads, "-ctk", "f16",
                 "-ctv", "f16", "-v"], env=self.env)
        found = {}
        for line in (r.stdout + "\n" + r.stderr).splitlines():
            if "Flash Attention" in line:
                found["flash_attn"] = line.split("Flash Attention", 1)[1].strip()
            elif "llama_kv_cache: size" in line:
                found["kv_cache"] = line.split("),", 1)[-1].strip()
            elif "model buffer size" in line:
                kind, size = line.split("load_tensors:", 1)[-1].split("model buffer size =")
                found.setdefault("weight_buffers", {})[kind.strip()] = size.strip()
        return found

    def prefill(self, model, n):
        res = self._bench(model, "prefill", "-p", n, "-n", 0)
        return res["avg_ts"], {"samples_ts": res.get("samples_ts"),
                               "weights_repacked": res["weights_repacked"]}

    def decode(self, model, depth, n):
        res = self._bench(model, "decode", "-p", 0, "-n", n, "-d", depth)
        assert res.get("n_depth", depth) == depth, res
        return res["avg_ts"], {"samples_ts": res.get("samples_ts"),
                               "weights_repacked": res["weights_repacked"]}

    def batched(self, model, batch, prompt_len, n):
        # Room for every sequence's prompt and tokens, and slack for llama.cpp's padding of
        # the context (a test that does not fit is silently left out).
        ctx = batch * (prompt_len + n) + 256
        r, repacked = self._with_fallback(
            model, "batched",
            [self.bindir / "llama-batched-bench", "-m", model, "-c", ctx, "-b", 2048, "-ub", 512,
             "-npp", prompt_len, "-ntg", n, "-npl", batch, "-t", self.threads, "-tb",
             self.threads, "-ctk", "f16", "-ctv", "f16", "--output-format", "jsonl"],
            ["--no-repack"])
        for line in (r.stdout + "\n" + r.stderr).splitlines():
            line = line.strip()
            if line.startswith("{") and "speed_tg" in line:
                j = json.loads(line)
                return j["speed_tg"], {"speed_pp": j["speed_pp"], "t_tg": j["t_tg"],
                                       "flash_attn": j.get("flash_attn"),
                                       "weights_repacked": repacked}
        raise RuntimeError(f"llama-batched-bench printed no result:\n{r.stderr[-2000:]}")


# ------------------------------------------------------------------------------------ figures

def figure_plan(args):
    figs = [(f"pp{n}", "prefill", {"n": n}) for n in args.prompt_lengths]
    figs += [(f"tg{args.decode_tokens}@d{d}", "decode", {"depth": d}) for d in args.depths]
    figs += [(f"b{b}", "batched", {"batch": b}) for b in args.batches]
    return figs


def measure_file(name, path, layout, kv, lc, args, bandwidth, work):
    rng = np.random.default_rng(1)
    # Ids below the tokenizer's special tokens (151643 and up), the same for every pair.
    ids = rng.integers(100, 150000, size=max(args.prompt_lengths + args.depths + [1]))
    figures = {}
    plan = figure_plan(args)
    for fig, kind, p in plan:
        if kind == "batched":
            pf = work / f"batch-{p['batch']}x{args.batch_prompt}.txt"
            words = [BATCH_WORDS[i % len(BATCH_WORDS)] for i in range(p["batch"])]
            pf.write_text("".join(" ".join([w] * args.batch_prompt) + "\n" for w in words))
        kv_tps, lc_tps, ratios, errors, kv_detail, lc_detail = [], [], [], [], [], []
        t_fig = time.monotonic()
        for pair in range(args.pairs):
            def kv_run():
                if kind == "prefill":
                    return kv.prefill(path, ids[:p["n"]].tolist())
                if kind == "decode":
                    return kv.decode(path, ids[:max(p["depth"], 1)].tolist(), args.decode_tokens)
                return kv.batched(path, pf, p["batch"], args.batch_prompt, args.decode_tokens)

            def lc_run():
                if kind == "prefill":
                    return lc.prefill(path, p["n"])
                if kind == "decode":
                    return lc.decode(path, p["depth"], args.decode_tokens)
                return lc.batched(path, p["batch"], args.batch_prompt, args.decode_tokens)

            order = [("kvgrid", kv_run), ("llama.cpp", lc_run)]
            if pair % 2:
                order.reverse()
            got = {}
            for engine, fn in order:
                try:
                    got[engine] = fn()
                except (RuntimeError, AssertionError, subprocess.TimeoutExpired,
                        json.JSONDecodeError, KeyError, IndexError) as e:
                    errors.append(f"{engine}: {str(e)[-600:]}")
            if "kvgrid" in got:
                kv_tps.append(got["kvgrid"][0])
                kv_detail.append(got["kvgrid"][1])
            if "llama.cpp" in got:
                lc_tps.append(got["llama.cpp"][0])
                lc_detail.append(got["llama.cpp"][1])
            if len(got) == 2 and got["llama.cpp"][0] > 0:
                ratios.append(got["kvgrid"][0] / got["llama.cpp"][0])
            log(f"{name} {fig} pair {pair + 1}/{args.pairs}: kvgrid "
                f"{got['kvgrid'][0] if 'kvgrid' in got else float('nan'):.1f} tok/s, llama.cpp "
                f"{got['llama.cpp'][0] if 'llama.cpp' in got else float('nan'):.1f} tok/s")
        f = {"kvgrid_tokens_per_s": kv_tps, "llama_cpp_tokens_per_s": lc_tps, "ratios": ratios,
             "median_ratio": statistics.median(ratios) if ratios else None,
             "kvgrid_median": statistics.median(kv_tps) if kv_tps else None,
             "llama_cpp_median": statistics.median(lc_tps) if lc_tps else None,
             "wall_s": time.monotonic() - t_fig}
        if kind == "batched" and kv_detail:
            f["kvgrid_prefill_tokens_per_s"] = [d["prefill_tokens_per_s"] for d in kv_detail]
            f["llama_cpp_prefill_tokens_per_s"] = [d["speed_pp"] for d in lc_detail]
        if kind == "decode":
            # Batch 1: every step reads the weights once and the F16 K/V of its context
            # (on average the depth plus half the decoded tokens).
            kv_bytes = (2 * 2 * args.layers * SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
                        * (p["depth"] + args.decode_tokens / 2))
            step = layout["decode_weight_bytes"] + kv_bytes
            roof = bandwidth * 1e9 / step
            f["bytes_per_step"] = step
            f["roofline_tokens_per_s"] = roof
            f["kvgrid_fraction_of_roofline"] = f["kvgrid_median"] / roof if kv_tps else None
            f["llama_cpp_fraction_of_roofline"] = (f["llama_cpp_median"] / roof if lc_tps
                                                   else None)
        if errors:
            f["errors"] = errors
        figures[fig] = f
    # Batched decode over each engine's own batch-1 decode (the issue's "6x kvgrid's own
    # batch-1 throughput"): the medians of bB and tg@d0 of this file, measured in this run.
    d0 = figures.get(f"tg{args.decode_tokens}@d0")
    batched = [fig for fig, kind, _ in plan if kind == "batched"]
    for fig, f in figures.items():
        if fig not in batched or d0 is None:
            continue
        for engine in ("kvgrid", "llama_cpp"):
            batch, one = f[f"{engine}_median"], d0[f"{engine}_median"]
            f[f"{engine}_over_batch1"] = batch / one if batch and one else None
    return figures


# ------------------------------------------------------------------------------------- output

def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def print_table(out):
    figs = list(out["files"][0]["figures"]) if out["files"] else []
    fa = out["llama_cpp"]["settings"].get("flash_attn")
    fa = {-1: "auto", 0: "off", 1: "on"}.get(fa, fa)
    print(f"kvgrid / llama.cpp, median of {out['pairs']} paired ratios; {out['threads']} "
          f"threads; K/V kvgrid {out['kvgrid']['kv_cache_dtype']}, llama.cpp "
          f"{out['llama_cpp']['settings'].get('type_k', 'f16')}; llama.cpp "
          f"{out['llama_cpp']['commit'][:10]} ({out['llama_cpp']['source']}), flash_attn {fa}")
    each = ", ".join(f"{x:.1f}" for x in out["bandwidth_gbs"]["each"])
    print(f"memory bandwidth: best {out['bandwidth_gbs']['best']:.1f} GB/s (each: {each}); "
          f"load average "
          f"{out['loadavg']['before']:.2f} -> {out['loadavg']['after']:.2f}; "
          f"{out['elapsed_s'] / 60:.1f} min\n")
    for line in out["llama_cpp"].get("fallbacks", []):
        print(f"llama.cpp fallback: {line}")
    if out["llama_cpp"].get("fallbacks"):
        print()
    print("| file | token_embd | MB read/token | " + " | ".join(figs) + " |")
    print("|---|---|---|" + "---|" * len(figs))
    for f in out["files"]:
        cells = [fmt(f["figures"][g]["median_ratio"]) for g in figs]
        print(f"| {f['name']} | {f['token_embd_type']} | {f['decode_weight_bytes'] / 1e6:.0f} | "
              + " | ".join(cells) + " |")
    print("\ntokens/s, kvgrid / llama.cpp (medians):\n")
    print("| file | " + " | ".join(figs) + " |")
    print("|---|" + "---|" * len(figs))
    for f in out["files"]:
        cells = [f"{fmt(f['figures'][g]['kvgrid_median'], '.1f')} / "
                 f"{fmt(f['figures'][g]['llama_cpp_median'], '.1f')}" for g in figs]
        print(f"| {f['name']} | " + " | ".join(cells) + " |")
    print("\nbatch-1 decode against the memory roofline (fraction of bandwidth / bytes per "
          "step):\n")
    print("| file | figure | roofline tok/s | kvgrid | llama.cpp |")
    print("|---|---|---|---|---|")
    for f in out["files"]:
        for g, v in f["figures"].items():
            if "roofline_tokens_per_s" in v:
                print(f"| {f['name']} | {g} | {v['roofline_tokens_per_s']:.1f} | "
                      f"{fmt(v['kvgrid_fraction_of_roofline'])} | "
                      f"{fmt(v['llama_cpp_fraction_of_roofline'])} |")
    scaled = [(f, g, v) for f in out["files"] for g, v in f["figures"].items()
              if "kvgrid_over_batch1" in v]
    if scaled:
        print("\nbatched decode over the same engine's batch-1 decode (tg@d0), medians:\n")
        print("| file | figure | kvgrid | llama.cpp |")
        print("|---|---|---|---|")
        for f, g, v in scaled:
            print(f"| {f['name']} | {g} | {fmt(v['kvgrid_over_batch1'])} | "
                  f"{fmt(v['llama_cpp_over_batch1'])} |")
    for f in out["files"]:
        for g, v in f["figures"].items():
            for e in v.get("errors", []):
                print(f"\n{f['name']} {g}: {e}")


def git_head():
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                       text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "kvgrid-peer",
                    help="llama.cpp's source and build, the model files (kept between runs)")
    ap.add_argument("--build", type=Path, default=ROOT / "build", help="kvgrid's build tree")
    ap.add_argument("--llama-cpp-python", default=LLAMA_CPP_PYTHON,
                    help="the sdist whose vendor/llama.cpp is built")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2,
                    help="parallel jobs for llama.cpp's build")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    all_files = list(kvgrid_files()) + list(LLAMA_FILES)
    ap.add_argument("--files", default=",".join(all_files),
                    help=f"comma-separated, of {','.join(all_files)}")
    ap.add_argument("--prompt-lengths", default="128,512")
    ap.add_argument("--depths", default="0,2048")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--batches", default="4,16")
    ap.add_argument("--batch-prompt", type=int, default=128)
    ap.add_argument("--kv-cache-dtype", default="fp16", help="kvgrid's (llama.cpp runs F16)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 2 layers, 2 pairs, the Q8_0 files, depth 512")
    ap.add_argument("--prepare-only", action="store_true",
                    help="build llama.cpp and write the model files, then stop")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--json-out", type=Path, help="also write that JSON object to this file")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.pairs = 2, 2
        if args.files == ",".join(all_files):
            args.files = "kvgrid-q8_0,llama-q8_0"
        if args.depths == "0,2048":
            args.depths = "0,512"
    args.prompt_lengths = [int(x) for x in args.prompt_lengths.split(",") if x]
    args.depths = [int(x) for x in args.depths.split(",") if x]
    args.batches = [int(x) for x in args.batches.split(",") if x]
    names = [n for n in args.files.split(",") if n]
    bad = [n for n in names if n not in all_files]
    if bad:
        ap.error(f"--files: unknown {bad}; known: {all_files}")
    kvgrid_exe = args.build / "bin" / "kvgrid"
    if not kvgrid_exe.is_file():
        sys.exit(f"peer_bench: {kvgrid_exe} not found: build the kvgrid target first")

    t_start = time.monotonic()
    args.work.mkdir(parents=True, exist_ok=True)
    try:
        llama_bin, llama_info = llama_cpp_tools(args.work, args.llama_cpp_python, args.jobs)
    except Skip as e:
        msg = f"skipped: llama.cpp is not available ({e})"
        if args.json:
            print(json.dumps({"skipped": str(e)}))
        else:
            print(f"peer_bench: {msg}")
        return 0
    paths = make_models(args.work, args.layers, names, llama_bin, args.llama_cpp_python)
    if args.prepare_only:
        for n in names:
            print(paths[n])
        return 0

    kv = Kvgrid(kvgrid_exe, args.threads, args.kv_cache_dtype)
    lc = LlamaCpp(llama_bin, args.threads)
    load_before = os.getloadavg()[0]
    # Measured before every file and at the end; the roofline takes the best, since a shared
    # machine only ever lowers what a short triad sees.
    bw = [bandwidth_gbs(args.threads)]
    log(f"memory bandwidth {bw[0]:.1f} GB/s ({args.threads} threads)")
    files = []
    for i, n in enumerate(names):
        if i:
            bw.append(bandwidth_gbs(args.threads))
        layout = file_layout(paths[n])
        log(f"{n}: {layout['tensor_types']}, token_embd {layout['token_embd_type']}, "
            f"{layout['decode_weight_bytes'] / 1e6:.0f} MB read per decode step")
        try:
            resolved = lc.probe(paths[n])
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            resolved = {"error": str(e)[-600:]}
        log(f"{n}: llama.cpp {resolved}")
        figures = measure_file(n, paths[n], layout, kv, lc, args, max(bw), args.work)
        files.append({"name": n, "path": str(paths[n]), "llama_cpp_resolved": resolved,
                      "made_by": (f"tools/export_gguf.py --type {n[len('kvgrid-'):]}"
                                  if n.startswith("kvgrid-") else
                                  f"llama-quantize kvgrid-f32.gguf {LLAMA_FILES[n]}"),
                      **layout, "figures": figures})
    bw.append(bandwidth_gbs(args.threads))
    # Files measured before the best triad used a lower figure: recompute with the best.
    for f in files:
        for v in f["figures"].values():
            if "bytes_per_step" in v:
                v["roofline_tokens_per_s"] = max(bw) * 1e9 / v["bytes_per_step"]
                for e in ("kvgrid", "llama_cpp"):
                    med = v[f"{e}_median"]
                    v[f"{e}_fraction_of_roofline"] = (med / v["roofline_tokens_per_s"]
                                                      if med else None)
    out = {
        "threads": args.threads, "pairs": args.pairs,
        "model": {"shape": "Qwen2-0.5B (random weights)", **SHAPE,
                  "num_hidden_layers": args.layers},
        "bandwidth_gbs": {"best": max(bw), "each": bw,
                          "method": "numpy a = b + c, 3 x 256 MiB, best of 5, threads as above, "
                                    "before each file and at the end; the roofline uses the best"},
        "loadavg": {"before": load_before, "after": os.getloadavg()[0]},
        "kvgrid": {"exe": str(kvgrid_exe), "commit": git_head(),
                   "kv_cache_dtype": args.kv_cache_dtype,
                   "timings": "kvgrid run --json timings (model load excluded, no warm-up)"},
        "llama_cpp": {**llama_info, "bin": str(llama_bin), "settings": lc.settings or {},
                      "fallbacks": lc.fallbacks,
                      "timings": "llama-bench -r 1 (after its warm-up pass), "
                                 "llama-batched-bench S_TG"},
        "figures": {fig: kind for fig, kind, _ in figure_plan(args)},
        "files": files,
        "elapsed_s": time.monotonic() - t_start,
    }
    if args.json_out:
        args.json_out.write_text(json.dumps(out, indent=1) + "\n")
    if args.json:
        print(json.dumps(out))
    else:
        print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
