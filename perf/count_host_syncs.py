"""Host syncs per decode step of a batch of 8 rows, by kind of row (issue #56 item 3: the counts).

    OMP_NUM_THREADS=1 python perf/count_host_syncs.py [--context 1000] [--rows 8] [--new-tokens 32] [--where]

What would make a GPU wait for the host, counted on this CPU (``sglang_kvx/ops/host_syncs.py``) over
whole forwards of a real server started with ``SGLANG_KVX_COUNT_HOST_SYNCS=1``: ``.item()``,
``.tolist()``, ``bool(t)``, ``.cpu()``, data-sized ops, tensors built from host data. Each kind sends
``--rows`` requests at once, so that they decode as one batch, and reads the last decode forward of
that batch size from ``/kvx/stats``. Kinds: ``plain`` rows; children of one context compacted by
KeyDiff at p = 0.5 with the ``flat``, ``pyramidkv`` (per-layer lengths, borrowed cells) and
``global`` (per-layer and per-head lengths) allocations; plain rows under the ``streamingllm`` and
``span_schedule`` decode steps (4 sinks, a 64-token window; Full every 3rd step); on tiny-hybrid-deep,
``plain`` rows, GateSight's ``gate`` children and ``oda`` rows (its shipped recall head, theta 0); under
``--kvx-sparse-attention 32`` (``tiny-llama:sparse``) plain rows and ``flat`` and ``pyramidkv`` children.
``--where`` adds each counted call's line (``kind@path:line``), to find them.
A count includes SGLang's own (the ``plain`` row of the same model); ``over_plain_per_layer`` is the
extension's share per attention layer. Prints one JSON object, last.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_oda import prompt  # perf/ is on the path when run as a script

from sglang_kvx.serve.launcher import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
COUNT_ENV = "SGLANG_KVX_COUNT_HOST_SYNCS"
# model -> (server flags, attention layers, {kind: what each request carries in custom_params.kvx})
MODELS = {
    "tiny-llama": (("--kvx-policy", "keydiff", "--kvx-keep-fraction", "0.5", "--kvx-decode-steps", "on"), 4, {
        "plain": None, "flat": {"allocation": "flat"}, "pyramidkv": {"allocation": "pyramidkv"},
        "global": {"allocation": "global"}, "streamingllm": {"decode": {"step": "streamingllm", "sinks": 4, "window": 64}},
        "span_schedule": {"decode": {"step": "span_schedule", "sinks": 4, "window": 64, "full_every": 3}}}),
    "tiny-hybrid-deep": (("--kvx-policy", "gatesight", "--kvx-keep-fraction", "0.2", "--kvx-decode-steps", "on"), 2, {
        "plain": None, "gate": {"allocation": "gate"}, "oda": {"decode": {"step": "oda", "sinks": 4, "window": 64}}}),
    # Block-sparse attention (32 tokens per query) for every row: plain rows and children of a flat and a
    # per-layer (folded) context; the plain row of tiny-llama above is SGLang's own count.
    "tiny-llama:sparse": (("--kvx-sparse-attention", "32", "--kvx-policy", "keydiff", "--kvx-keep-fraction", "0.5"), 4, {
        "plain": None, "flat": {"allocation": "flat"}, "pyramidkv": {"allocation": "pyramidkv"}}),
}


def count_kind(server: ServerProcess, kind: str, fields: dict | None, args, seed: int) -> dict[str, dict]:
    """The last decode forward of ``args.rows`` rows of this kind: host syncs by kind of call; and, where a
    forward of the batch re-ran only some of its rows (On-Demand Attention), the last such forward's, as
    ``<kind> partial re-run``."""
    partial_key = f"decode[{args.rows}] partial re-run"
    before = server.stats().get("host_syncs", {}).get(partial_key, {}).get("forward", 0)
    context = prompt(seed, args.context, 500)
    is_child = fields is not None and "allocation" in fields
    if is_child:  # the parent: compacted with this allocation, then its children
        parent = server.generate({"input_ids": context, "sampling_params": {
            "max_new_tokens": 0, "custom_params": {"kvx": fields}}})
        parent.raise_for_status()
    requests_ = []
    for row in range(args.rows):
        question = prompt(seed * 100 + row, 16, 500)
        params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
        if fields is not None:  # a child names its context's settings, as its parent did
            params["custom_params"] = {"kvx": fields}
        ids = context + question if is_child else prompt(seed * 100 + row, args.context, 500) + question
        requests_.append({"input_ids": ids, "sampling_params": params})
    with ThreadPoolExecutor(args.rows) as pool:
        bodies = [r.json() for r in pool.map(server.generate, requests_)]
    if is_child:
        assert all((b["meta_info"].get("kvx") or [{}])[-1].get("child") for b in bodies), kind
    records = server.stats().get("host_syncs", {})
    counted = records.get(f"decode[{args.rows}]")
    if counted is None:
        raise RuntimeError(f"{kind}: no decode of {args.rows} rows was counted: {records}")
    server.flush()
    found = {kind: counted}
    if records.get(partial_key, {}).get("forward", 0) > before:
        found[f"{kind} partial re-run"] = records[partial_key]
    # "forward": the record's number, not a count
    return {name: {key: value for key, value in record.items() if key != "forward"} for name, record in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1000, help="tokens of each context (default: 1000)")
    parser.add_argument("--rows", type=int, default=8, help="requests decoding as one batch (default: 8)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens each request generates (default: 32)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated (default: {','.join(MODELS)})")
    parser.add_argument("--where", action="store_true", help="each counted call's line too")
    args = parser.parse_args()
    result = {"context": args.context, "rows": args.rows, "per_decode_step": {}, "over_plain_per_layer": {}}
    for name in args.models.split(","):
        flags, layers, kinds = MODELS[name]
        with ServerProcess(ROOT / "weights" / name.split(":")[0], *flags, "--context-length", str(args.context + 64),
                           max_total_tokens=args.rows * (args.context + 64) + 2 * args.context,
                           env={COUNT_ENV: "where" if args.where else "1"}) as server:
            counts = {}
            for seed, (kind, fields) in enumerate(kinds.items()):
                counts.update(count_kind(server, kind, fields, args, seed))
        plain = result["per_decode_step"].get(f"{name.split(':')[0]}/plain", counts["plain"])["total"]  # SGLang's own
        for kind, counted in counts.items():
            result["per_decode_step"][f"{name}/{kind}"] = counted
            if kind != "plain":
                result["over_plain_per_layer"][f"{name}/{kind}"] = round((counted["total"] - plain) / layers, 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
