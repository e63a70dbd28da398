"""The embedded demo models: a tiny Qwen3.5-architecture hybrid and a tiny dense Llama.

Both are real checkpoints (config.json, model.safetensors, tokenizer) in
``weights/<name>/``, loadable by SGLang and by HF transformers alike. They are
built from a seed here, so a fresh machine needs no download. A trained model
replaces a random one by writing into the same folder; nothing else changes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from sglang_kvx.models.tokenizer import VOCAB_SIZE, build_tokenizer

# The embedded default: 8 layers (3 GDN + 1 gated attention, twice), grown from tiny-hybrid-ruler
# and fine-tuned on the evaluation suite (training/finetune_ruler.py --grow 2); ships trained.
DEFAULT_MODEL = "tiny-hybrid-deep"
DEMO_MODELS = ("tiny-hybrid-deep", "tiny-hybrid", "tiny-llama", "tiny-llama-ruler")  # shipped in weights/
TRAINED_ONLY = {
    "tiny-hybrid-deep": "python -m sglang_kvx.training.finetune_ruler --init weights/tiny-hybrid-ruler "
                        "--out weights/tiny-hybrid-deep --grow 2 --minutes 30",
    # The dense model of the dense-only comparisons, trained the same way (commands in its kvx_demo.json).
    "tiny-llama-ruler": "python -m sglang_kvx.training.train_demo --arch tiny-llama --out weights/tiny-llama-trained "
                        "--minutes 25, then finetune_ruler --init weights/tiny-llama-trained --out weights/tiny-llama-ruler "
                        "--minutes 25 --lengths 512,1024,2048",
}
# Built on demand (tests): a second dense architecture, and Qwen3-Next (the other hybrid SGLang serves).
EXTRA_MODELS = ("tiny-qwen3", "tiny-qwen3-next")

# Large enough for the long-context benchmarks (4K+ contexts plus questions).
MAX_POSITIONS = 32768
# Random demo weights are drawn wider than the usual 0.02 so that greedy
# decoding is not degenerate: a test comparing tokens must be able to fail.
INIT_STD = 0.1


def weights_root() -> Path:
    """Where demo checkpoints live: ``$SGLANG_KVX_WEIGHTS`` or the repository's ``weights/``."""
    env = os.environ.get("SGLANG_KVX_WEIGHTS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "weights"


def demo_model_path(name: str = DEFAULT_MODEL) -> Path:
    """Path of a demo checkpoint; raises with the fix if it was not built yet."""
    if name not in DEMO_MODELS:
        raise ValueError(f"unknown demo model {name!r}; choose one of {', '.join(DEMO_MODELS)}")
    path = weights_root() / name
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"demo model {name!r} not found at {path}; build it with `sglang-kvx build-demo`"
        )
    return path


def _tokenizer_ids(tok_dir: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}


def _dense_config(config_cls, num_layers: int, ids: dict[str, int]):
    """The tiny dense shape both dense demo architectures share."""
    return config_cls(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=INIT_STD,
        dtype="float32",
        **ids,
    )


def llama_config(ids: dict[str, int]):
    from transformers import LlamaConfig

    return _dense_config(LlamaConfig, 4, ids)


def qwen3_config(ids: dict[str, int]):
    """Dense Qwen3: per-head q/k RMSNorm before RoPE."""
    from transformers import Qwen3Config

    return _dense_config(Qwen3Config, 2, ids)


def _hybrid_shape(ids: dict[str, int], blocks: int) -> dict:
    """The tiny hybrid shape both hybrid architectures share: ``blocks`` x (3 GDN + 1 gated attention)."""
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4 * blocks,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * blocks,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        initializer_range=INIT_STD,
        dtype="float32",
        **ids,
    )


def hybrid_config(ids: dict[str, int]):
    """Qwen3.5 text architecture: three Gated-DeltaNet layers, then one gated full-attention layer."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        **_hybrid_shape(ids, blocks=1),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
    )


def qwen3_next_config(ids: dict[str, int]):
    """Qwen3-Next: the hybrid pattern twice, grouped GDN projections, a sparse MoE block in every
    layer (4 experts, top 2, plus a gated shared expert), partial RoPE."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **_hybrid_shape(ids, blocks=2),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
    )


def _long_memory_decay_(model: torch.nn.Module, seed: int) -> None:
    """Give GDN heads a spread of half-lives (dt log-uniform in [1e-3, 0.1]).

    transformers' default init wipes the recurrent state almost every token;
    GateSight needs slow heads that remember, next to fast ones that forget.
    """
    gen = torch.Generator().manual_seed(seed + 1)
    for module in model.modules():
        if hasattr(module, "dt_bias") and hasattr(module, "A_log"):
            n = module.dt_bias.numel()
            dt = torch.exp(torch.rand(n, generator=gen) * (torch.log(torch.tensor(0.1)) - torch.log(torch.tensor(1e-3))) + torch.log(torch.tensor(1e-3)))
            with torch.no_grad():
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
                module.A_log.copy_(torch.log(torch.empty(n).uniform_(1, 16, generator=gen)))


def _distinct_output_gates_(model: torch.nn.Module, seed: int) -> None:
    """Open the first gated attention layer's output gate and close the last one's.

    Random weights leave every output gate at sigmoid(~0) = 0.5 on average, so gate-proportional
    budgets would split evenly. A direction shared by all token embeddings, read positively by the
    first layer's gate rows and negatively by the last one's, gives the layers the distinct gate
    openness real models have.
    """
    gen = torch.Generator().manual_seed(seed + 2)
    layers = [layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn")]
    if len(layers) < 2:
        return
    config = model.config
    shared = torch.randn(config.hidden_size, generator=gen)
    shared /= shared.norm()
    head_dim = config.head_dim
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(shared)
        for sign, attn in ((1.0, layers[0]), (-1.0, layers[-1])):
            rows = attn.q_proj.weight.view(config.num_attention_heads, 2 * head_dim, -1)[:, head_dim:]
            rows.add_(sign * 0.5 * shared)


def build_demo_model(name: str, out_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Build one demo checkpoint with random weights (deterministic in ``seed``)."""
    from transformers import AutoModelForCausalLM

    out = Path(out_dir) if out_dir else weights_root() / name
    build_tokenizer(out, seed=seed)
    ids = _tokenizer_ids(out)
    builders = {"tiny-llama": llama_config, "tiny-hybrid": hybrid_config, "tiny-qwen3": qwen3_config,
                "tiny-qwen3-next": qwen3_next_config}
    hybrid = name in ("tiny-hybrid", "tiny-qwen3-next")
    if name not in builders:
        raise ValueError(f"unknown demo model {name!r}; choose one of {', '.join(builders)}")
    config = builders[name](ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if hybrid:
        _long_memory_decay_(model, seed)
    if name == "tiny-qwen3-next":
        _distinct_output_gates_(model, seed)
    model.save_pretrained(out, safe_serialization=True)
    if hybrid:
        # SGLang's Qwen3.5 / Qwen3-Next configs derive their layer pattern from this key.
        config_file = out / "config.json"
        saved = json.loads(config_file.read_text())
        saved["full_attention_interval"] = 4
        config_file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    meta = {"name": name, "seed": seed, "trained": False}
    (out / "kvx_demo.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def ensure_demo_models(names: tuple[str, ...] = DEMO_MODELS) -> list[Path]:
    """Build whichever demo checkpoints are missing; return their paths."""
    paths = []
    for name in names:
        path = weights_root() / name
        if not (path / "config.json").exists():
            if name in TRAINED_ONLY:
                raise FileNotFoundError(f"{path} is missing and has no random stand-in; retrain it: {TRAINED_ONLY[name]}")
            build_demo_model(name, path)
        paths.append(path)
    return paths
