#!/usr/bin/env python3
"""Streams a completion from a kvgrid coordinator to stdout.

    python3 clients/python/examples/generate.py --addr 127.0.0.1:50051 \\
        --prompt "In the beginning" --max-new-tokens 64 --temperature 0.8 --seed 1
"""

import argparse
import sys
from pathlib import Path

# Runs from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from kvgrid_client import Client, finish_reason_name  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description="Stream a completion from a kvgrid coordinator.")
    ap.add_argument("--addr", default="127.0.0.1:50051", help="coordinator host:port")
    ap.add_argument("--prompt", default="In the beginning")
    ap.add_argument("--model", default="", help="a model from ListModels (default: the only one)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, help="0: greedy (default: 1)")
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--stop", action="append", help="a stop string (repeatable)")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--timeout", type=float, help="deadline in seconds")
    args = ap.parse_args()

    with Client(args.addr, timeout=args.timeout) as client:
        stream = client.generate(args.prompt, model=args.model,
                                 max_new_tokens=args.max_new_tokens,
                                 temperature=args.temperature, top_p=args.top_p,
                                 top_k=args.top_k, seed=args.seed, stop=args.stop,
                                 ignore_eos=args.ignore_eos)
        try:
            sys.stdout.write(args.prompt)
            for r in stream:
                sys.stdout.write(r.text)
                sys.stdout.flush()
                if r.finish_reason:
                    print(f"\n[{r.usage.prompt_tokens} prompt tokens, "
                          f"{r.usage.completion_tokens} generated, "
                          f"finish: {finish_reason_name(r.finish_reason)}, "
                          f"worker {r.worker_id}, {r.timings.finished_s:.3f} s]",
                          file=sys.stderr)
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            stream.cancel()
            return 130
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
