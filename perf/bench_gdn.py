"""GDN prefill/decode on the CPU: chunked vs token-by-token rule, and the whole served model.

    OMP_NUM_THREADS=1 python perf/bench_gdn.py [--tokens 4096]

Prints one JSON object. Ratios are measured in one run (these machines are noisy).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from sglang_kvx.ops.gdn import gated_delta_rule_chunked, gated_delta_rule_recurrent


def timed(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--serve", action="store_true", help="also time a real server prefill of the demo hybrid")
    args = parser.parse_args()
    torch.manual_seed(0)
    T, Hk, Hv, D = args.tokens, 2, 4, 32  # the demo hybrid's GDN layer shape
    q, k = torch.randn(T, Hk, D), torch.randn(T, Hk, D)
    v = torch.randn(T, Hv, D)
    g, beta = -torch.rand(T, Hv) * 0.1, torch.rand(T, Hv)
    chunked = timed(lambda: gated_delta_rule_chunked(q, k, v, g, beta))
    state = torch.zeros(Hv, D, D)
    recurrent = timed(lambda: gated_delta_rule_recurrent(q[:512], k[:512], v[:512], g[:512], beta[:512], state), repeat=1) * T / 512
    result = {
        "tokens": T,
        "threads": torch.get_num_threads(),
        "gdn_layer_chunked_s": round(chunked, 4),
        "gdn_layer_chunked_tokens_per_s": round(T / chunked),
        "gdn_layer_recurrent_s_estimated": round(recurrent, 4),
        "chunked_speedup_over_recurrent": round(recurrent / chunked, 1),
    }
    if args.serve:
        from sglang_kvx.models.demo import ensure_demo_models, weights_root
        from sglang_kvx.serve.launcher import ServerProcess

        ensure_demo_models()
        with ServerProcess(weights_root() / "tiny-hybrid", max_total_tokens=T + 1024) as server:
            ids = torch.randint(10, 500, (T,)).tolist()
            t0 = time.perf_counter()
            server.generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}).raise_for_status()
            result["server_startup_s"] = round(server.startup_seconds, 1)
            result["server_prefill_s"] = round(time.perf_counter() - t0, 3)
            result["server_prefill_tokens_per_s"] = round(T / result["server_prefill_s"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
