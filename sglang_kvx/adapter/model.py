"""What the runtime needs of the served model, read from SGLang's model config."""

from __future__ import annotations

from typing import Any, Callable

import torch

from sglang_kvx.config import traits_of_config


def attention_and_gdn_layer_ids(hf_config: Any) -> tuple[list[int], list[int]]:
    """Model layer ids of the full-attention and GDN layers, from the config's published forms
    (``layer_types``, ``full_attention_interval``, a ``text_config`` nested in a multimodal one)."""
    traits = traits_of_config(hf_config.to_dict())
    return list(traits.attention_layer_ids), list(traits.gdn_layer_ids)


def rope_inv_freq(hf_text_config: Any, head_dim: int) -> Callable[[], torch.Tensor]:
    """The model's RoPE frequencies (default RoPE; partial rotary as configured), computed on first use."""
    cached: list[torch.Tensor] = []

    def frequencies() -> torch.Tensor:
        if not cached:
            params = getattr(hf_text_config, "rope_parameters", None) or {}
            rope_type = params.get("rope_type", "default")
            if rope_type != "default":
                raise NotImplementedError(f"sglang_kvx: query statistics for rope_type {rope_type!r}")
            theta = float(params.get("rope_theta", getattr(hf_text_config, "rope_theta", 10000.0)))
            partial = float(params.get("partial_rotary_factor", getattr(hf_text_config, "partial_rotary_factor", 1.0)))
            rotary_dim = int(head_dim * partial)
            cached.append(1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        return cached[0]

    return frequencies
