"""The CPU attention backend's extend against SGLang's torch-native one, at one layer's shape.

    OMP_NUM_THREADS=1 python perf/bench_cpu_extend.py [--cases 8191+1,32767+1,24576+8192] [--repeats 1]

An extend reads a row's cached prefix and appends new tokens: a question after a radix-cache hit
(prefix + 1, or a few tokens), or a later prefill chunk (prefix + chunk). SGLang's torch-native
backend runs causal attention from every position of the row and keeps the new tokens' rows;
``kvx_torch_native`` (``sglang_kvx/adapter/attention.py``) computes the new tokens' queries only.
Both run here on the same paged pool (SmolLM2-135M's attention shape by default: 9 query heads,
3 KV heads, head dim 64; one layer, so a model pays this times its layers). Prints one JSON
object: per case (prefix + new tokens) each backend's median seconds, their ratio and the
largest output difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sglang_kvx.adapter.attention import KvxTorchNativeAttnBackend


def run(backend, query, pool, prefix: int, new: int) -> tuple[float, torch.Tensor]:
    k_cache, v_cache, req_to_token = pool
    out = torch.empty_like(query)
    t0 = time.perf_counter()
    backend._run_sdpa_forward_extend(query, out, k_cache, v_cache, req_to_token, torch.tensor([0]),
                                     torch.tensor([prefix + new]), torch.tensor([prefix]), torch.tensor([new]),
                                     scaling=query.shape[-1] ** -0.5, enable_gqa=True, causal=True)
    return time.perf_counter() - t0, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="8191+1,32767+1,24576+8192", help="prefix+new pairs (default: %(default)s)")
    parser.add_argument("--q-heads", type=int, default=9, help="query heads (default: %(default)s, SmolLM2-135M)")
    parser.add_argument("--kv-heads", type=int, default=3, help="KV heads (default: %(default)s)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per backend and case (median kept)")
    args = parser.parse_args()
    try:
        cases = [tuple(int(x) for x in case.split("+")) for case in args.cases.split(",")]
        if any(len(c) != 2 or c[0] < 0 or c[1] < 1 for c in cases):
            raise ValueError
    except ValueError:
        parser.error(f"--cases must be prefix+new pairs with new >= 1, got {args.cases!r}")
    torch.set_num_threads(1)
    theirs = object.__new__(TorchNativeAttnBackend)
    ours = object.__new__(KvxTorchNativeAttnBackend)
    gen = torch.Generator().manual_seed(0)
    result: dict = {"shape": {"q_heads": args.q_heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim},
                    "torch_threads": 1, "cases": {}}
    for prefix, new in cases:
        slots = prefix + new
        pool = (torch.randn(slots, args.kv_heads, args.head_dim, generator=gen),
                torch.randn(slots, args.kv_heads, args.head_dim, generator=gen),
                torch.randperm(slots, generator=gen).to(torch.int32)[None])  # a shuffled page table
        query = torch.randn(new, args.q_heads, args.head_dim, generator=gen)
        timings: dict[str, list[float]] = {"sglang_torch_native_s": [], "kvx_torch_native_s": []}
        for _ in range(args.repeats):
            seconds, want = run(theirs, query, pool, prefix, new)
            timings["sglang_torch_native_s"].append(seconds)
            seconds, got = run(ours, query, pool, prefix, new)
            timings["kvx_torch_native_s"].append(seconds)
        row = {name: round(statistics.median(values), 5) for name, values in timings.items()}
        row["speedup"] = round(row["sglang_torch_native_s"] / row["kvx_torch_native_s"], 2)
        row["max_abs_diff"] = float((got - want).abs().max())
        result["cases"][f"{prefix}+{new}"] = row
        print(f"{prefix}+{new}: {row}", flush=True, file=sys.stderr)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
