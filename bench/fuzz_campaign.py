#!/usr/bin/env python3
"""Long fuzzing campaigns outside CI: each libFuzzer target of tests/fuzz (built by
tools/ci-fuzz.sh into build-fuzz/, clang with ASan + UBSan) runs until it has executed --runs
inputs (default 10 million), starting from the seeds in tests/fuzz/corpus/<target>/ and
keeping what it learns in build-fuzz/campaign/<target>/ (so a campaign can be resumed). For
each target it reports the executions, the seconds, the rate, the corpus it grew and whether
anything was found (a crash, leak, timeout, out-of-memory or sanitizer report; the input is
left in build-fuzz/campaign/<target>/artifacts/).

A campaign also ends after --max-seconds (default: none), so a short one reports how far it
got.

Usage: bench/fuzz_campaign.py [--json] [--runs 10000000] [--max-seconds S] [--targets a,b]
                              [--jobs 2] [--nice 19] [--timeout 30]
"""

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build-fuzz"
TARGETS = ["safetensors_fuzz", "model_config_fuzz", "tokenizer_fuzz", "gguf_fuzz", "jinja_fuzz",
           "openai_request_fuzz", "grpc_request_fuzz", "kserve_request_fuzz"]


def campaign(target: str, runs: int, niceness: int, max_seconds: int, timeout: int) -> dict:
    exe = BUILD / "bin" / target
    if not exe.is_file():
        raise SystemExit(f"{exe} is missing: run tools/ci-fuzz.sh (it builds build-fuzz/) first")
    work = BUILD / "campaign" / target
    corpus, artifacts = work / "corpus", work / "artifacts"
    corpus.mkdir(parents=True, exist_ok=True)
    artifacts.mkdir(parents=True, exist_ok=True)
    for seed in (ROOT / "tests" / "fuzz" / "corpus" / target).iterdir():
        if not (corpus / seed.name).exists():
            shutil.copy(seed, corpus / seed.name)
    before = len(list(corpus.iterdir()))
    log = work / "log"
    t0 = time.monotonic()
    # ASan records the stack of every allocation in a depot that only grows. Its fast unwinder
    # follows frame pointers, which Debian's libprotobuf does not keep, so past the first frame
    # inside it the stacks hold stray words and nearly every allocation is a new entry: over a
    # long grpc_request_fuzz run the depot's hash chains took 52% of the time (with 30 frames
    # and with 8) and the rate fell from ~5,000 to ~940 per second. Two frames (the allocator
    # and its caller) are always real return addresses. Prepended, so that a caller's own
    # ASAN_OPTIONS (later options win) still decides.
    env = dict(os.environ)
    env["ASAN_OPTIONS"] = ":".join(
        x for x in ("malloc_context_size=2", os.environ.get("ASAN_OPTIONS", "")) if x)
    with open(log, "wb") as out:
        rc = subprocess.run(
            ["nice", "-n", str(niceness), str(exe), f"-runs={runs}",
             *([f"-max_total_time={max_seconds}"] if max_seconds > 0 else []),
             f"-timeout={timeout}",
             "-rss_limit_mb=2048", "-max_len=65536", "-print_final_stats=1",
             f"-artifact_prefix={artifacts}/", str(corpus)],
            stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    seconds = time.monotonic() - t0
    text = log.read_text(errors="replace")
    m = re.search(r"^stat::number_of_executed_units:\s*(\d+)", text, re.M)
    executed = int(m.group(1)) if m else 0
    # libFuzzer also keeps inputs slower than -report_slow_units (10 s of wall time, which a
    # starved nice-19 run reaches easily): listed, but only -timeout makes one a hang.
    slow = sorted(p.name for p in artifacts.iterdir() if p.name.startswith("slow-unit-"))
    findings = sorted(p.name for p in artifacts.iterdir() if not p.name.startswith("slow-unit-"))
    return {"target": target, "executions": executed, "reached": executed >= runs,
            "seconds": round(seconds, 1),
            "executions_per_s": round(executed / seconds) if seconds > 0 else 0,
            "corpus_before": before, "corpus_after": len(list(corpus.iterdir())),
            "exit_code": rc, "finding": rc != 0 or bool(findings), "artifacts": findings,
            "slow_units": slow}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--runs", type=int, default=10_000_000)
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--jobs", type=int, default=2, help="targets run at once")
    ap.add_argument("--nice", type=int, default=19)
    ap.add_argument("--max-seconds", type=int, default=0, help="per target; 0: no limit")
    ap.add_argument("--timeout", type=int, default=30,
                    help="seconds one input may run before it counts as a hang (wall time: at "
                         "--nice 19 a busy machine can starve the fuzzer, so more than CI's 10)")
    args = ap.parse_args()
    targets = [t for t in args.targets.split(",") if t]
    results = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(campaign, t, args.runs, args.nice, args.max_seconds,
                               args.timeout) for t in targets]
        for f in futures:
            results.append(f.result())
            if not args.json:
                print(" ".join(f"{k}={v}" for k, v in results[-1].items()), flush=True)
    if args.json:
        print(json.dumps({"machine": f"{os.cpu_count()} cores", "runs_asked": args.runs,
                          "results": results}, indent=2))
    raise SystemExit(1 if any(r["finding"] for r in results) else 0)


if __name__ == "__main__":
    main()
