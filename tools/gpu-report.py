#!/usr/bin/env python3
"""Prints the figures of a tools/gpu-check.sh run, compactly, against the GPU issue's targets.

Reads the JSON the CUDA benchmarks wrote into a results folder (cuda_attention_bench.json,
cuda_decode_bench.json, serve_bench.json; any may be missing) and prints one line per figure:

  attention  decode attention bandwidth per KV dtype at 8K context (else the longest run), the
             best batch, against the peak the bench used (target >= 70% for fp16, int8, int4
             and fp8_e4m3)
  decode     batch 1 tokens/s against the weight-streaming roofline (weights + the KV rows a
             step reads, at the attention bench's peak; target >= 75%), and for every larger
             batch eager vs graphs and each quantized KV dtype against fp16 (the target: int8
             >= 1.3x at batch 32)
  serving    serve_bench output tokens/s, TTFT and TPOT percentiles

    python3 tools/gpu-report.py RESULTS_DIR
"""

import json
import sys
from pathlib import Path


def load(folder: Path, name: str):
    try:
        return json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return None


def attention_lines(att):
    peak = att.get("peak_gbs") or 0
    rows = att.get("results", [])
    if not rows or peak <= 0:
        return [], peak
    # The target is set at 8K; a run without 8K rows shows its longest context.
    contexts = {r["context"] for r in rows}
    context = 8192 if 8192 in contexts else max(contexts)
    lines = [f"attention: {att.get('device', '?')}, peak {peak:.0f} GB/s "
             f"({att.get('peak_source', '?')}), context {context}, target >= 70% at 8192"]
    for dtype in dict.fromkeys(r["k_dtype"] for r in rows):
        at = [r for r in rows if r["k_dtype"] == dtype and r["context"] == context]
        if not at:
            continue
        best = max(at, key=lambda r: r["gb_per_s"])
        mark = "ok" if best["fraction_of_peak"] >= 0.70 else "BELOW"
        lines.append(f"  {dtype:9s} batch {best['batch']:3d}: {best['gb_per_s']:8.1f} GB/s "
                     f"{100 * best['fraction_of_peak']:5.1f}% {mark}")
    return lines, peak


def decode_lines(dec, peak):
    rows = dec.get("results", [])
    if not rows:
        return []
    weights = dec.get("weight_bytes", 0)
    lines = [f"decode: {dec.get('model', '?')}, weights {weights / 1e9:.2f} GB"]

    def row(batch, kv, graphs):
        for r in rows:
            if r["batch"] == batch and r["kv_dtype"] == kv and r["cuda_graphs"] == graphs:
                return r
        return None

    one = row(1, "fp16", True) or row(1, "fp16", False)
    if one:
        text = (f"  batch 1 fp16 KV: {one['output_tokens_per_s']:.1f} tok/s, "
                f"{one['step_ms']:.3f} ms/step")
        if peak > 0:
            # The pool holds the sequence's rows: about what one step reads of the KV cache.
            floor_ms = (weights + one["kv_bytes"]) / (peak * 1e9) * 1e3
            share = floor_ms / one["step_ms"]
            text += (f", roofline {floor_ms:.3f} ms -> {100 * share:.1f}% "
                     f"{'ok' if share >= 0.75 else 'BELOW'} (target >= 75%)")
        lines.append(text)
    for batch in sorted({r["batch"] for r in rows if r["batch"] > 1}):
        eager, graphs = row(batch, "fp16", False), row(batch, "fp16", True)
        if eager and graphs:
            lines.append(f"  batch {batch} fp16 KV: eager {eager['output_tokens_per_s']:.0f}, "
                         f"graphs {graphs['output_tokens_per_s']:.0f} tok/s "
                         f"({graphs['output_tokens_per_s'] / eager['output_tokens_per_s']:.2f}x)")
        base = graphs or eager
        for kv in ("int8", "int4", "fp8_e4m3"):
            r = row(batch, kv, base["cuda_graphs"]) if base else None
            if r and base:
                ratio = r["output_tokens_per_s"] / base["output_tokens_per_s"]
                target = ""
                if kv == "int8":
                    target = f" {'ok' if ratio >= 1.3 else 'BELOW'} (target >= 1.3x)"
                lines.append(f"  batch {batch} {kv} KV: {r['output_tokens_per_s']:.0f} tok/s, "
                             f"{ratio:.2f}x fp16{target}")
    return lines


def serving_lines(srv):
    load_ = srv.get("load")
    if not load_:
        return []
    cfg = load_.get("config", {})
    ttft, tpot = load_.get("ttft_ms", {}), load_.get("tpot_ms", {})
    return [f"serving: {cfg.get('num_prompts')} requests, concurrency "
            f"{cfg.get('max_concurrency')}, in {cfg.get('input_len')} / out "
            f"{cfg.get('output_len')} tokens: {load_.get('completed')} done, "
            f"{load_.get('failed')} failed",
            f"  {load_.get('output_token_throughput', 0):.0f} output tok/s, "
            f"TTFT p50 {ttft.get('p50', 0):.1f} p99 {ttft.get('p99', 0):.1f} ms, "
            f"TPOT p50 {tpot.get('p50', 0):.2f} p99 {tpot.get('p99', 0):.2f} ms"]


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    folder = Path(sys.argv[1])
    lines, peak = [], 0
    att = load(folder, "cuda_attention_bench.json")
    if att:
        more, peak = attention_lines(att)
        lines += more
    dec = load(folder, "cuda_decode_bench.json")
    if dec:
        lines += decode_lines(dec, peak)
    srv = load(folder, "serve_bench.json")
    if srv:
        lines += serving_lines(srv)
    print("\n".join(lines) if lines else "(no benchmark figures yet)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
