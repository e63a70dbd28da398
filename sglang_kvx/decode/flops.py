"""The ODA FLOPs ledger (seed 003, appendix B.8, equations 24-25; notation of A.6), SGLang-free.

Per routed decode step t (t = 1 .. len(schedule); step t feeds output token t, the prefill made
the first), the history read by Full is n_t = prompt_len + t keys (the current one included) and
Local reads l_t = min(n_t, sinks + window). With a_t = schedule[t-1] (True: the step was re-run
with Full):

    Eq. 24   F_Full = sum_t [ B + A(n_t) + O ]
    Eq. 25   F_ODA  = sum_t [ (1 + a_t) B + A(l_t) + a_t A(n_t) + R + O ]

B  history-independent backbone work of one one-token forward: every linear layer (attention
   QKV / output projections, gated-attention gates, GDN projections, MLPs; 2 FLOPs per weight)
   plus the GDN short conv and recurrent state update (independent of the history length).
A(n) attention over n keys, summed over the *attention* layers only (a hybrid's GDN layers are in
   B): QK^T and PV, 2 * 2 * n * query_heads * head_dim per layer. Scales with query heads.
R  the recall head, once per routed step (2 FLOPs per head weight).
O  the vocabulary projection, once per step in both methods (only the selected branch is projected).

An analytical count of major operations, not measured hardware FLOPs or a latency prediction.
"""

from __future__ import annotations

from typing import Any

from sglang_kvx.decode.recall_head import load_model_config


def _head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def _layer_types(cfg: dict[str, Any]) -> list[str]:
    return list(cfg.get("layer_types") or ["full_attention"] * int(cfg["num_hidden_layers"]))


def backbone_linear_flops(cfg: dict[str, Any]) -> int:
    """B: FLOPs of one token through every layer's history-independent work."""
    h = int(cfg["hidden_size"])
    hd, nq, nkv = _head_dim(cfg), int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    # Qwen3.5 / Qwen3-Next attention layers gate their output: q_proj emits a gate as wide as q.
    gated = str(cfg.get("model_type", "")).startswith(("qwen3_5", "qwen3_next"))
    attn = h * nq * hd * (2 if gated else 1) + 2 * h * nkv * hd + nq * hd * h
    if cfg.get("num_experts_per_tok"):  # MoE: the routed experts a token activates, plus a shared one
        mlp = 3 * h * int(cfg["moe_intermediate_size"]) * int(cfg["num_experts_per_tok"])
        mlp += 3 * h * int(cfg.get("shared_expert_intermediate_size") or 0) + h * int(cfg.get("num_experts") or 0)
    else:
        mlp = 3 * h * int(cfg["intermediate_size"])
    total = 0
    for kind in _layer_types(cfg):
        if kind == "linear_attention":
            nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
            dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
            key_dim, value_dim = nk * dk, nv * dv
            conv_dim = 2 * key_dim + value_dim
            proj = h * conv_dim + h * value_dim + 2 * h * nv + value_dim * h  # qkv, z, b/a, out
            conv = conv_dim * int(cfg.get("linear_conv_kernel_dim", 4))
            recurrent = 4 * nv * dk * dv  # decay, S^T k, rank-1 write, q^T S: ~4 dk*dv MACs a head
            total += 2 * (proj + mlp + conv + recurrent)
        else:
            total += 2 * (attn + mlp)
    return total


def attention_flops(cfg: dict[str, Any], keys: int) -> int:
    """A(n): one query token attending to ``keys`` keys in every attention layer (QK^T and PV)."""
    layers = sum(1 for kind in _layer_types(cfg) if kind != "linear_attention")
    return layers * 4 * keys * int(cfg["num_attention_heads"]) * _head_dim(cfg)


def output_flops(cfg: dict[str, Any]) -> int:
    """O: the vocabulary projection of one hidden state."""
    return 2 * int(cfg["hidden_size"]) * int(cfg["vocab_size"])


def recall_head_flops(hidden_size: int, width: int | None = None, ffn: int | None = None) -> int:
    """R for a RecallHead of these widths (same defaults as the head)."""
    width = width or max(16, hidden_size // 2)
    ffn = ffn or 2 * width
    return 2 * (3 * hidden_size * width + 9 * width * width + 2 * 3 * width * ffn + width)


def oda_flops(config: Any, prompt_len: int, schedule: list[bool], *, sinks: int = 4, window: int = 128,
              head_flops: int | None = None) -> dict[str, float]:
    """Full-only and ODA FLOPs of decoding ``len(schedule)`` routed steps after a ``prompt_len``
    prefill, with ``schedule[t-1]`` True where step t ran Full. ``config``: config.json's dict, an
    HF config, or a model directory. ``head_flops``: R per step (default: a RecallHead of the
    default width for this hidden size). Prefill (identical in both) is not counted."""
    cfg = load_model_config(config)
    B, O = backbone_linear_flops(cfg), output_flops(cfg)
    R = recall_head_flops(int(cfg["hidden_size"])) if head_flops is None else int(head_flops)
    local_span = sinks + window
    full = oda = 0
    attn_full = attn_local = attn_rerun = 0
    for t, a in enumerate(schedule, start=1):
        n = prompt_len + t
        A_n, A_l = attention_flops(cfg, n), attention_flops(cfg, min(n, local_span))
        full += B + A_n + O  # Eq. 24
        oda += (1 + a) * B + A_l + a * A_n + R + O  # Eq. 25
        attn_full += A_n
        attn_local += A_l
        attn_rerun += a * A_n
    steps = len(schedule)
    return {
        "steps": steps,
        "full_calls": int(sum(schedule)),
        "full_rate": (sum(schedule) / steps) if steps else 0.0,
        "full_flops": float(full),
        "oda_flops": float(oda),
        "saved_fraction": (1.0 - oda / full) if full else 0.0,
        "backbone_per_step": float(B),
        "output_per_step": float(O),
        "head_per_step": float(R),
        "attention_full_total": float(attn_full),
        "attention_local_total": float(attn_local),
        "attention_rerun_total": float(attn_rerun),
        "rerun_backbone_total": float(B * sum(schedule)),
    }
