"""On-Demand Attention's recall head (seed 003, section 2.2 and appendix A.2), SGLang-free.

At every routed decode step the serving side runs Local attention first (``sinks`` first keys plus
the ``window`` most recent, the current token included), then asks the head whether Full attention
is worth re-running the step:

    score = head(prev_h, emb, local_h)        # one scalar per row
    take Full iff score > theta  (theta = 0 by default)  or  score is not finite

The three inputs, each a float tensor ``[..., hidden_size]`` (any leading batch shape; the head
casts to float32 and returns ``[...]``):

``prev_h``  the *previous selected hidden state*: the final hidden state (see ``local_h``) of the
            previous step's committed branch, Local or Full, whichever was kept. For the first
            routed step (the one that consumes the token the prefill produced) it is the prefill's
            final hidden state at the prompt's last position.
``emb``     the *embedding* of the current input token: the model's input embedding row,
            ``embed_tokens(token)`` (no scaling, no norm), for the token this step feeds.
``local_h`` the *final hidden state* of the current step's Local attempt: the input of the LM head,
            i.e. after the model's final norm (``model.norm``), at this step's position.

After the step, the committed branch's final hidden state becomes the next step's ``prev_h``.

Architecture (A.2, widths scaled to our models): each input goes through its own tower
RMSNorm -> Linear(hidden, width, bias) -> SiLU, giving a, b, c. The interaction vector is
u = [a; b; c; a*b; |a-b|; a*c; |a-c|; b*c; |b-c|] (9 * width); z0 = (a + b + c + SiLU(W_f u + b_f)) / 2;
two pre-RMSNorm residual SwiGLU blocks (bias-free width -> ffn gate/up, ffn -> width down); a
final RMSNorm and a biased scalar projection. FP32 weights and arithmetic.

On disk (``weights/oda/<model>/``): ``head.safetensors`` and ``manifest.json``; the manifest names
the model the head was trained for (name, hidden size, vocab, ``config_hash``), the Local span
(sinks, window), the penalty lambda, tau_hist, the head's widths, the training data and split, the
command and its measured results. ``RecallHead.from_pretrained`` refuses a head whose manifest does
not match the model it is asked to serve.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn
import torch.nn.functional as F

HEAD_FILE = "head.safetensors"
MANIFEST_FILE = "manifest.json"

# The config fields that fix a model's shapes; the hash over them identifies "the same model
# architecture" whether the serving side holds config.json's dict or an HF config object (whose
# to_dict() adds many defaulted fields that config.json need not spell out).
_ARCH_KEYS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "layer_types",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
)


def load_model_config(model_config_or_path: Any) -> dict[str, Any]:
    """The model's config as a plain dict, from a dict, an object with ``to_dict()`` (an HF config),
    a model directory or a ``config.json`` path. A multimodal wrapper's ``text_config`` is used."""
    cfg = model_config_or_path
    if isinstance(cfg, (str, Path)):
        path = Path(cfg)
        path = path / "config.json" if path.is_dir() else path
        cfg = json.loads(path.read_text())
    elif not isinstance(cfg, Mapping):
        cfg = cfg.to_dict()
    cfg = dict(cfg)
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = dict(cfg["text_config"])
    return cfg


def config_hash(model_config_or_path: Any) -> str:
    """sha256 over the model's architecture fields (``_ARCH_KEYS``), canonical JSON."""
    cfg = load_model_config(model_config_or_path)
    picked = {key: cfg.get(key) for key in _ARCH_KEYS}
    if picked["head_dim"] is None and cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        picked["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if not picked["layer_types"]:  # a dense model: every layer is attention
        picked["layer_types"] = ["full_attention"] * int(cfg.get("num_hidden_layers", 0))
    if picked["tie_word_embeddings"] is None:
        picked["tie_word_embeddings"] = False
    text = json.dumps(picked, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Tower(nn.Module):
    """RMSNorm -> biased projection -> SiLU, one per input."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden)
        self.proj = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.proj(self.norm(x)))


class SwiGLUBlock(nn.Module):
    """Pre-RMSNorm residual SwiGLU, bias-free."""

    def __init__(self, width: int, ffn: int) -> None:
        super().__init__()
        self.norm = RMSNorm(width)
        self.gate = nn.Linear(width, ffn, bias=False)
        self.up = nn.Linear(width, ffn, bias=False)
        self.down = nn.Linear(ffn, width, bias=False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.norm(z)
        return z + self.down(F.silu(self.gate(x)) * self.up(x))


class RecallHead(nn.Module):
    """score = head(prev_h, emb, local_h): the predicted (signed-log, cost-adjusted) benefit of
    Full attention at this step. See the module docstring for what each input is."""

    def __init__(self, hidden_size: int, width: int | None = None, ffn: int | None = None) -> None:
        super().__init__()
        width = width or max(16, hidden_size // 2)  # A.2: 2048 -> 1024 towers, 2048-wide SwiGLU
        ffn = ffn or 2 * width
        self.hidden_size, self.width, self.ffn = hidden_size, width, ffn
        self.towers = nn.ModuleList([Tower(hidden_size, width) for _ in range(3)])
        self.fusion = nn.Linear(9 * width, width)
        self.blocks = nn.ModuleList([SwiGLUBlock(width, ffn) for _ in range(2)])
        self.norm = RMSNorm(width)
        self.out = nn.Linear(width, 1)
        self.manifest: dict[str, Any] = {}
        self.float()

    @property
    def sinks(self) -> int | None:
        return self.manifest.get("sinks")

    @property
    def window(self) -> int | None:
        return self.manifest.get("window")

    def forward(self, prev_h: torch.Tensor, emb: torch.Tensor, local_h: torch.Tensor) -> torch.Tensor:
        a, b, c = (tower(x.float()) for tower, x in zip(self.towers, (prev_h, emb, local_h)))
        u = torch.cat([a, b, c, a * b, (a - b).abs(), a * c, (a - c).abs(), b * c, (b - c).abs()], dim=-1)
        z = 0.5 * (a + b + c + F.silu(self.fusion(u)))
        for block in self.blocks:
            z = block(z)
        return self.out(self.norm(z)).squeeze(-1)

    @torch.no_grad()
    def route(self, prev_h: torch.Tensor, emb: torch.Tensor, local_h: torch.Tensor, theta: float = 0.0) -> torch.Tensor:
        """Bool ``[...]``: True where the step should be re-run with Full (score > theta, or not finite)."""
        score = self(prev_h, emb, local_h)
        return (score > theta) | ~torch.isfinite(score)

    def flops(self) -> int:
        """Multiply-adds x 2 of one scoring (per row); elementwise work ignored."""
        return 2 * sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))

    # --- disk -------------------------------------------------------------------------------

    def save_pretrained(self, path: str | Path, manifest: dict[str, Any]) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().float().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(path / HEAD_FILE))
        full = {**manifest, "head": {"hidden_size": self.hidden_size, "width": self.width, "ffn": self.ffn,
                                     "parameters": sum(p.numel() for p in self.parameters())}}
        (path / MANIFEST_FILE).write_text(json.dumps(full, indent=2) + "\n")
        self.manifest = full

    @classmethod
    def from_pretrained(cls, path: str | Path, model_config_or_path: Any, model_name: str | None = None,
                        check_name: bool = True) -> "RecallHead":
        """Load ``path/head.safetensors`` for the model described by ``model_config_or_path`` (a
        config dict, an HF config object, a model directory or its config.json).

        Raises ValueError naming both models when the head was trained for another model: a
        different hidden size, vocabulary or architecture hash, or (when ``model_name`` is given, or
        ``model_config_or_path`` is a model directory, whose folder name is then the model's name) a
        different model name; ``check_name=False`` skips only the name (a renamed copy of the model)."""
        from safetensors.torch import load_file

        path = Path(path)
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        cfg = load_model_config(model_config_or_path)
        if model_name is None and isinstance(model_config_or_path, (str, Path)) and Path(model_config_or_path).is_dir():
            model_name = Path(model_config_or_path).resolve().name
        trained = manifest.get("model", {})
        head_for = f"{trained.get('name')!r} (hidden {trained.get('hidden_size')}, vocab {trained.get('vocab_size')}, config {str(trained.get('config_hash'))[:12]})"
        serving = f"{model_name!r} (hidden {cfg.get('hidden_size')}, vocab {cfg.get('vocab_size')}, config {config_hash(cfg)[:12]})"
        problems = []
        if trained.get("hidden_size") != cfg.get("hidden_size"):
            problems.append("hidden size")
        if trained.get("vocab_size") != cfg.get("vocab_size"):
            problems.append("vocabulary")
        if trained.get("config_hash") != config_hash(cfg):
            problems.append("architecture (config hash)")
        if check_name and model_name is not None and trained.get("name") != model_name:
            problems.append("name")
        if problems:
            raise ValueError(f"recall head at {path} was trained for model {head_for}, not for {serving}: "
                             f"{', '.join(problems)} differ(s); train a head for this model "
                             f"(python -m sglang_kvx.training.train_recall_head --model <its path>)")
        shape = manifest["head"]
        head = cls(shape["hidden_size"], shape["width"], shape["ffn"])
        head.load_state_dict(load_file(str(path / HEAD_FILE)))
        head.manifest = manifest
        return head.eval()


def signed_log(u: torch.Tensor) -> torch.Tensor:
    """Eq. 7: T(u) = sign(u) log(1 + |u|), the regression target's compression."""
    return torch.sign(u) * torch.log1p(u.abs())
