"""GDN prefill/decode on the CPU: chunked vs token-by-token rule, and the whole served model.

    OMP_NUM_THREADS=1 python perf/bench_gdn.py [--tokens 4096] [--serve [--url URL]]

Prints one JSON object. Ratios are measured in one run (these machines are noisy). ``--serve``
also times a real server's prefill of ``tiny-hybrid`` (a server of its own, whose start-up is
reported too); with ``--url`` the server already running there (flushed first), whose model is
then reported (``server_model``) and whose start-up was not seen (no ``server_startup_s``).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from sglang_kvx.ops.gdn import gated_delta_rule_chunked, gated_delta_rule_recurrent
from sglang_kvx.serve.launcher import add_url_option, urls_from_args


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
    add_url_option(parser, ("server",))
    args = parser.parse_args()
    url = urls_from_args(parser, args.url, ("server",)).get("server")
    if url and not args.serve:
        parser.error("--url is the server --serve times: pass --serve too")
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
        from pathlib import Path

        from sglang_kvx.models.demo import ensure_demo_models, weights_root
        from sglang_kvx.serve.launcher import server_or_url
        from served import describe  # perf/ is on the path when run as a script

        ensure_demo_models()
        with server_or_url(url, weights_root() / "tiny-hybrid", max_total_tokens=T + 1024) as server:
            model = "tiny-hybrid"
            if url:
                served = describe(url)
                served.require_context(T + 1, f"a {T}-token prefill and one new token")
                served.require_pool(T + 1, f"a {T}-token prefill")
                model = Path(served.model_path).name
                server.flush()  # a prefill, not a prefix-cache hit of an earlier run's same prompt
            ids = torch.randint(10, 500, (T,)).tolist()
            t0 = time.perf_counter()
            server.generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}).raise_for_status()
            result["server_model"] = model
            if server.startup_seconds is not None:
                result["server_startup_s"] = round(server.startup_seconds, 1)
            result["server_prefill_s"] = round(time.perf_counter() - t0, 3)
            result["server_prefill_tokens_per_s"] = round(T / result["server_prefill_s"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
