"""``kvzap`` / ``kvzap_linear``: KVzip+'s keep-sets predicted from each token's own hidden states.

Jegou & Jeblick, "KVzap: Fast, Adaptive, and Faithful KV Cache Pruning" (arXiv:2601.07891, 2026;
github.com/NVIDIA/kvpress, ``KVzapPress`` under ``DMSPress``). Per attention layer a small surrogate
maps each token's input hidden state h_t (after the layer's input norm: what q/k/v read) to one
predicted log KVzip+ score per KV head (``policies/kvzip.py``: s_i = max_j a_ji ||W_O^h v_i|| / ||h_j||
over the repeated context): ``kvzap`` a 2-layer MLP, Linear(D, D/8) -> GELU -> Linear(D/8, H_kv),
``kvzap_linear`` one Linear(D, H_kv), both trained per checkpoint with MSE on log KVzip+
(``training/train_kvzap.py``, shipped under ``weights/kvzap/<model>/{mlp,linear}``).

Rule (the paper's, the default ``threshold`` allocation): every entry whose predicted score is under
the threshold tau is dropped, each layer, KV head and token on its own (heads keep different counts;
the context folds over (layer, KV head) cells, ``compact/layout.fold_heads``, and frees what they do
not hold), the last ``window`` = 128 tokens always kept (the paper's LongBench-LCC ablation: 28.4
without them, 62.5 with them), no sinks. The kept fraction is an outcome (``kept_fraction`` in the
response's ``meta_info.kvx``). tau: ``--kvx-kvzap-threshold``, else the surrogate's manifest's (chosen
on its held-out texts; the paper's best were -4 on Qwen3 and -7 on Llama-3.1-8B, whose score
distributions differ: a tau is per model). Budget mode (ours; the paper has none): ``"allocation":
"global"`` (or any other budget) keeps ``keep_fraction`` of the entries past the protected prefix
under one threshold over every layer and KV head, as KVzip's budgets, with no window unless
``--kvx-kvzap-window`` names one: a window is counted in the budget and, at small budgets, takes all
of it (SmolLM2 at 1K, p = 0.2: 52.5 with the 128-token window, 75.0 without; KVzip 68.3).

The scores cost one small matmul per layer on hidden states the prefill computes anyway: on one rank
each prefill chunk is scored inside the forward and its hidden states let go (``ChunkScoring.hidden``),
so a parent holds [kv_heads, n] scores per layer, never the n x hidden states.

Where kvpress differs (``DMSPress(KVzapPress(...), threshold, sliding_window_size=128)``): it masks
the dropped keys (a fake key per query) and frees no memory, where here they are gone from the pool;
its window is the context's last 128 tokens, as here; it loads surrogates by a hub name derived from
the model's (``nvidia/KVzap-<kind>-<model>``), here by a fingerprint of the checkpoint, and a
surrogate trained for another checkpoint is refused; its MLP width is fixed at 512 in its trainer,
here D/8 as in the paper (72 on SmolLM2-135M). The paper's surrogates are trained on 1.2M tokens of
Nemotron pretraining prompts of 750-1250 tokens; ours on the package's generated long texts (other
seeds than any evaluation's), see ``training/train_kvzap.py``. Under tensor parallelism each rank
scores every head from the (replicated) hidden states and keeps its own; the budget mode's one
threshold over every head is refused there, as KVzip's.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from sglang_kvx.gatesight.estimator import config_hash, model_fingerprint
from sglang_kvx.policies.base import KVPolicy, check_layer, layer_signal, register_policy
from sglang_kvx.signals import CaptureSpec, ChunkScoring, ContextSignals

FORMAT = "sglang_kvx.kvzap/1"
MANIFEST_FILE = "manifest.json"
CONFIG_FILE = "config.json"  # kvpress's KVzapConfig fields: the folder loads as its KVzapModel too
WEIGHTS_FILE = "model.safetensors"
KINDS = ("mlp", "linear")
WINDOW = 128


class SurrogateMismatch(ValueError):
    """The surrogate is missing, or was trained for another checkpoint."""


def train_command(model_path: str | Path) -> str:
    return f"python -m sglang_kvx.training.train_kvzap --model {model_path}"


@dataclass
class KVzapSurrogate:
    """One checkpoint's per-layer surrogates: ``layers[l]`` holds ``weight`` [H, D], ``bias`` [H]
    (linear) or ``w1`` [D/8, D], ``b1``, ``w2`` [H, D/8], ``b2`` (MLP)."""

    kind: str
    layers: list[dict[str, torch.Tensor]]
    manifest: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"surrogate kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        self._on: dict[torch.device, list[dict[str, torch.Tensor]]] = {}

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_kv_heads(self) -> int:
        return int(self.layers[0]["bias" if self.kind == "linear" else "b2"].shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.layers[0]["weight" if self.kind == "linear" else "w1"].shape[1])

    def score(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Predicted log KVzip+ of each token: [kv_heads, t] float32 from hidden [t, D]."""
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden states of width {hidden.shape[-1]} do not fit a surrogate of width {self.hidden_size}")
        if hidden.device not in self._on:
            self._on[hidden.device] = [{k: v.to(hidden.device) for k, v in p.items()} for p in self.layers]
        p = self._on[hidden.device][layer]
        h = hidden.float()
        if self.kind == "linear":
            return (h @ p["weight"].T + p["bias"]).T
        return (F.gelu(h @ p["w1"].T + p["b1"]) @ p["w2"].T + p["b2"]).T

    # --- files: kvpress's KVzapModel layout plus our manifest ---------------------------------

    def save(self, directory: str | Path) -> Path:
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        names = {"weight": "weight", "bias": "bias"} if self.kind == "linear" else {
            "w1": "0.weight", "b1": "0.bias", "w2": "2.weight", "b2": "2.bias"}
        tensors = {f"layers.{i}.{names[k]}": v.detach().float().contiguous().cpu()
                   for i, p in enumerate(self.layers) for k, v in p.items()}
        save_file(tensors, str(out / WEIGHTS_FILE))
        config = {"model_type": "kvzap", "architectures": ["KVzapModel"], "input_dim": self.hidden_size,
                  "output_dim": self.num_kv_heads, "n_modules": self.num_layers,
                  "hidden_dim": None if self.kind == "linear" else int(self.layers[0]["w1"].shape[0])}
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        (out / MANIFEST_FILE).write_text(json.dumps({"format": FORMAT, "kind": self.kind, **self.manifest}, indent=1) + "\n")
        return out

    @classmethod
    def load(cls, directory: str | Path, model_path: str | Path | None = None) -> "KVzapSurrogate":
        """A surrogate folder; with ``model_path``, refused unless it was trained for that checkpoint."""
        from safetensors.torch import load_file

        root = Path(directory)
        if not all((root / f).is_file() for f in (MANIFEST_FILE, CONFIG_FILE, WEIGHTS_FILE)):
            raise SurrogateMismatch(f"{root} holds no KVzap surrogate ({MANIFEST_FILE}, {CONFIG_FILE}, {WEIGHTS_FILE})")
        manifest = json.loads((root / MANIFEST_FILE).read_text())
        if manifest.get("format") != FORMAT:
            raise SurrogateMismatch(f"{root / MANIFEST_FILE}: format {manifest.get('format')!r}, expected {FORMAT!r}")
        if model_path is not None:
            check_trained_for(manifest, model_path, root)
        config = json.loads((root / CONFIG_FILE).read_text())
        tensors = load_file(str(root / WEIGHTS_FILE))
        kind = "linear" if config.get("hidden_dim") is None else "mlp"
        names = {"weight": "weight", "bias": "bias"} if kind == "linear" else {
            "w1": "0.weight", "b1": "0.bias", "w2": "2.weight", "b2": "2.bias"}
        layers = [{k: tensors[f"layers.{i}.{v}"].float() for k, v in names.items()} for i in range(int(config["n_modules"]))]
        return cls(kind, layers, {k: v for k, v in manifest.items() if k not in ("format", "kind")})


def check_trained_for(manifest: dict[str, Any], model_path: str | Path, where: str | Path) -> None:
    """Refuse a surrogate not trained for ``model_path`` (config hash, then the weights' fingerprint)."""
    name = manifest.get("model_name")
    if manifest.get("config_hash") != config_hash(model_path):
        raise SurrogateMismatch(f"KVzap surrogate {where} was trained for model {name!r}, whose config.json differs "
                                f"from {model_path}'s; train one with: {train_command(model_path)}")
    if manifest.get("model_fingerprint") != model_fingerprint(model_path):
        raise SurrogateMismatch(f"KVzap surrogate {where} was trained for model {name!r} (the same config.json but "
                                f"other weights), not for {model_path}; train one with: {train_command(model_path)}")


def find_surrogate(model_path: str | Path, kind: str, folder: str | Path | None = None) -> Path:
    """The ``kind`` surrogate trained for ``model_path``: in ``folder/<kind>`` when given, else
    ``<model>/kvzap/<kind>``, then every ``weights/kvzap/*/<kind>`` whose manifest names this checkpoint."""
    from sglang_kvx.models.demo import weights_root

    if folder:
        return Path(folder) / kind
    fingerprint, config = model_fingerprint(model_path), config_hash(model_path)
    candidates = [Path(model_path) / "kvzap" / kind] + sorted(p / kind for p in (weights_root() / "kvzap").glob("*"))
    for candidate in candidates:
        manifest_file = candidate / MANIFEST_FILE
        if manifest_file.is_file():
            manifest = json.loads(manifest_file.read_text())
            if manifest.get("model_fingerprint") == fingerprint and manifest.get("config_hash") == config:
                return candidate
    raise SurrogateMismatch(f"no KVzap {kind} surrogate was trained for {model_path}; train one with: "
                            f"{train_command(model_path)} (or pass --kvx-kvzap-surrogates DIR)")


@register_policy("kvzap")
class KVzapPolicy(KVPolicy):
    needs = frozenset({"hidden_states"})
    allocation = "threshold"
    kind: ClassVar[str] = "mlp"
    # Under --tp-size > 1 every rank holds the whole hidden states: it scores every KV head and keeps
    # its own (``ContextSignals.kv_heads``); the threshold decides each head alone, so ranks agree.

    def __init__(self, *, surrogate: KVzapSurrogate | str | Path | None = None, model_path: str | Path | None = None,
                 threshold: float | None = None, window: int | None = None) -> None:
        """``window``: the last tokens always kept; None = the rule's own (128 under the threshold
        rule, none under a budget: ``under``)."""
        if window is not None and window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        if surrogate is None:
            if model_path is None:
                raise SurrogateMismatch(f"{self.name} needs a surrogate: pass surrogate=DIR or model_path=MODEL")
            surrogate = find_surrogate(model_path, self.kind)
        if not isinstance(surrogate, KVzapSurrogate):
            surrogate = KVzapSurrogate.load(surrogate, model_path=model_path)
        if surrogate.kind != self.kind:
            raise SurrogateMismatch(f"{self.name} reads a {self.kind} surrogate; {surrogate.kind!r} given")
        self.surrogate = surrogate
        self.threshold = float(threshold if threshold is not None else surrogate.manifest.get("threshold", float("nan")))
        if self.threshold != self.threshold:
            raise SurrogateMismatch(f"{self.name}: no threshold given and the surrogate's manifest has none")
        self.window = window

    def under(self, allocation: str) -> "KVzapPolicy":
        """Under a budget (any allocation but the threshold rule) the window is the one given, else none."""
        if allocation == self.allocation or self.window is not None:
            return self
        budgeted = copy.copy(self)
        budgeted.window = 0
        return budgeted

    @classmethod
    def from_config(cls, config) -> "KVzapPolicy":
        """The surrogate trained for ``--model-path`` (or ``--kvx-kvzap-surrogates``), the server's tau and window."""
        model_path = getattr(config, "model_path", "") or None
        if model_path is None:
            raise SurrogateMismatch(f"{cls.name} needs the served checkpoint's path to find its surrogate")
        folder = getattr(config, "kvzap_surrogates", "") or None
        return cls(surrogate=find_surrogate(model_path, cls.kind, folder), model_path=model_path,
                   threshold=getattr(config, "kvzap_threshold", None), window=getattr(config, "kvzap_window", None))

    @property
    def allocation_options(self) -> dict[str, Any]:
        return {"threshold": self.threshold}

    def captures(self) -> CaptureSpec:
        return CaptureSpec(hidden_states=2)  # the vectors (or, on one rank, scores chunk by chunk)

    def chunk_scoring(self) -> ChunkScoring:
        return ChunkScoring(hidden=self.surrogate.score)

    def _own_heads(self, signals: ContextSignals) -> slice:
        """The surrogate's KV heads this context keeps entries for (a tensor-parallel rank's own)."""
        start, end = signals.kv_heads or (0, signals.num_kv_heads)
        if (signals.num_layers != self.surrogate.num_layers or end - start != signals.num_kv_heads
                or end > self.surrogate.num_kv_heads or (signals.kv_heads is None and end != self.surrogate.num_kv_heads)):
            raise ValueError(f"the KVzap surrogate covers {self.surrogate.num_layers} attention layers x "
                             f"{self.surrogate.num_kv_heads} KV heads; this model has {signals.num_layers} x "
                             f"{signals.num_kv_heads} (heads {start}-{end - 1})")
        return slice(start, end)

    def score(self, signals: ContextSignals, layer: int, budget: int | None = None) -> torch.Tensor:
        """Predicted log KVzip+ per KV head and entry; the last ``window`` entries +inf (always kept)."""
        check_layer(signals, layer)
        heads = self._own_heads(signals)
        if signals.streamed_scores is not None:  # scored chunk by chunk inside the prefill (one rank)
            scores = signals.streamed_scores[layer].float().clone()
        else:
            scores = self.surrogate.score(layer, layer_signal(signals, "hidden_states", layer, self.name))[heads]
        window = WINDOW if self.window is None else self.window
        if window:
            scores[:, max(0, signals.n - window) :] = float("inf")
        return scores.to(signals.score_device)


@register_policy("kvzap_linear")
class KVzapLinearPolicy(KVzapPolicy):
    """KVzap with the linear surrogate (the paper's best on Llama-3.1-8B)."""

    kind = "linear"
