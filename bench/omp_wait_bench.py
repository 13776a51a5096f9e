#!/usr/bin/env python3
"""What libgomp's wait policy costs and buys: decode speed (build/bin/decode_bench, batch 1,
every core) alone on the machine and with a second copy running at the same time (two workers
sharing the cores, as `kvgrid serve --workers 2` on one machine, or a worker beside a busy
coordinator), for each policy in turn, interleaved over --rounds so that drift hits all alike.

Policies: libgomp's default (spin ~300k iterations at each barrier before sleeping), passive
(OMP_WAIT_POLICY=passive: sleep at once), and GOMP_SPINCOUNT=N (spin N iterations, then sleep).

  bench/omp_wait_bench.py [--json] [--rounds 3] [--weight-dtype q8_0] [--decode-tokens 48]
                          [--policies default,passive,spin10000]
"""

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def env_for(policy: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy == "passive":
        env["OMP_WAIT_POLICY"] = "passive"
    elif policy == "active":
        env["OMP_WAIT_POLICY"] = "active"
    elif policy.startswith("spin"):
        env["GOMP_SPINCOUNT"] = policy[len("spin"):]
    elif policy != "default":
        raise SystemExit(f"unknown policy {policy}")
    return env


def decode(exe: Path, policy: str, copies: int, args) -> list:
    cmd = [str(exe), "--json", "--repeats", "1", "--prompt-len", "32", "--decode-tokens",
           str(args.decode_tokens), "--weight-dtype", args.weight_dtype]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env_for(policy)) for _ in range(copies)]
    rates = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"decode_bench failed under {policy}: {err[-1000:]}")
        rates.append(json.loads(out)["decode_tokens_per_s"])
    return rates


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--build", type=Path, default=ROOT / "build")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--weight-dtype", default="q8_0")
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--policies", default="default,passive,spin10000")
    args = ap.parse_args()
    exe = args.build / "bin" / "decode_bench"
    policies = args.policies.split(",")
    alone = {p: [] for p in policies}
    shared = {p: [] for p in policies}
    for _ in range(args.rounds):
        for p in policies:
            alone[p] += decode(exe, p, 1, args)
            shared[p].append(sum(decode(exe, p, 2, args)))
    rows = []
    for p in policies:
        rows.append({"policy": p,
                     "alone_tokens_per_s": round(statistics.median(alone[p]), 2),
                     "two_copies_total_tokens_per_s": round(statistics.median(shared[p]), 2)})
    base = rows[0]
    for r in rows:
        r["alone_vs_first"] = round(r["alone_tokens_per_s"] / base["alone_tokens_per_s"], 3)
        r["two_copies_vs_first"] = round(
            r["two_copies_total_tokens_per_s"] / base["two_copies_total_tokens_per_s"], 3)
    result = {"cores": os.cpu_count(), "weight_dtype": args.weight_dtype,
              "decode_tokens": args.decode_tokens, "rounds": args.rounds, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for r in rows:
            print(" ".join(f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
