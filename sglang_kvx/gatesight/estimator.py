"""GateSight's per-(attention layer, KV head) utility estimators: weights, manifest, scoring.

Each estimator is a one-hidden-layer MLP (64 units, ReLU) on the standardised features of
``gatesight.features``. All of a model's estimators live in one safetensors file as stacked
tensors, with a manifest naming the model they were trained for (its fingerprint and, since
GPU training, its config hash); loading them for another model is refused (the features would
mean something else), and the refusal names the command that trains the right ones.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sglang_kvx.checkpoint import text_config
from sglang_kvx.ops.gatesight import mlp_utility

FORMAT = "sglang_kvx.gatesight/1"
WEIGHTS_FILE = "estimator.safetensors"
MANIFEST_FILE = "manifest.json"
_FINGERPRINT_SAMPLE = 1 << 20  # bytes hashed from each end of a weights file
# A checkpoint this large takes hours to label on CPU: the training hint then names a GPU.
_GPU_HINT_BYTES = 256 << 20


class EstimatorMismatch(ValueError):
    """The estimator was trained for a different model."""


def model_fingerprint(model_path: str | Path) -> str:
    """sha256 over config.json and each safetensors file's name, size, first and last MiB: cheap
    for any model size, different for any two checkpoints we would confuse."""
    root = Path(model_path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root} has no config.json: not a local model checkpoint")
    digest = hashlib.sha256((root / "config.json").read_bytes())
    for weights in sorted(root.glob("*.safetensors")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with weights.open("rb") as f:
            digest.update(f.read(_FINGERPRINT_SAMPLE))
            f.seek(max(0, size - _FINGERPRINT_SAMPLE))
            digest.update(f.read())
    return digest.hexdigest()


def config_hash(model_path: str | Path) -> str:
    """sha256 of the checkpoint's config.json as canonical JSON (sorted keys, no whitespace): the
    architecture the estimator's features are laid out for, whatever the file's formatting.
    Recorded beside the fingerprint so a refusal can say whether the config or the weights differ."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{model_path} has no config.json: not a local model checkpoint")
    canonical = json.dumps(json.loads(config_file.read_text()), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def train_command(model_path: str | Path) -> str:
    """The command that trains estimators for ``model_path``; a large checkpoint gets the GPU
    options (in its own dtype when that is a 16-bit one)."""
    command = f"python -m sglang_kvx.training.train_gatesight --model {model_path}"
    root = Path(model_path)
    if sum(f.stat().st_size for f in root.glob("*.safetensors")) >= _GPU_HINT_BYTES:
        command += " --device cuda"
        try:
            cfg = text_config(json.loads((root / "config.json").read_text()))
            dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "")
        except (OSError, ValueError):
            dtype = ""
        command += f" --dtype {dtype if dtype in ('bfloat16', 'float16') else 'bfloat16'}"
    return command


@dataclass
class GateSightEstimator:
    w1: torch.Tensor  # [L, H, F, U]
    b1: torch.Tensor  # [L, H, U]
    w2: torch.Tensor  # [L, H, U]
    b2: torch.Tensor  # [L, H]
    feature_mean: torch.Tensor  # [L, F]
    feature_std: torch.Tensor  # [L, F]
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.w1.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.w1.shape[1]

    @property
    def num_features(self) -> int:
        return self.w1.shape[2]

    def folded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1, b1) with the standardisation folded in: the op then reads raw features."""
        inv_std = 1.0 / self.feature_std  # [L, F]
        w1 = self.w1 * inv_std[:, None, :, None]
        b1 = self.b1 - torch.einsum("lf,lhfu->lhu", self.feature_mean * inv_std, self.w1)
        return w1, b1

    def score(self, features: torch.Tensor, impl: str = "auto", layers: slice = slice(None)) -> torch.Tensor:
        """features [L', n, F] (raw) of the attention layers ``layers`` (default all) -> predicted utility [L', H, n]."""
        if not hasattr(self, "_folded") or self._folded[0].device != features.device:
            w1, b1 = self.folded()
            self._folded = tuple(t.to(features.device) for t in (w1, b1, self.w2, self.b2))
        weights = tuple(t[layers] for t in self._folded)
        if features.shape[0] != weights[0].shape[0] or features.shape[2] != self.num_features:
            raise ValueError(
                f"features {tuple(features.shape)} do not fit estimators for {weights[0].shape[0]} layers of {self.num_features} features"
            )
        return mlp_utility(features, *weights, impl=impl)

    # --- files -----------------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {name: getattr(self, name).detach().float().contiguous().cpu()
                   for name in ("w1", "b1", "w2", "b2", "feature_mean", "feature_std")}
        save_file(tensors, str(out / WEIGHTS_FILE))
        (out / MANIFEST_FILE).write_text(json.dumps({"format": FORMAT, **self.manifest}, indent=2) + "\n")
        return out

    @classmethod
    def load(cls, directory: str | Path, model_path: str | Path | None = None) -> "GateSightEstimator":
        """Load estimators; with ``model_path``, refuse them unless they were trained for that model."""
        from safetensors.torch import load_file

        root = Path(directory)
        manifest_file = root / MANIFEST_FILE
        if not manifest_file.is_file() or not (root / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(f"{root} holds no GateSight estimator ({MANIFEST_FILE} + {WEIGHTS_FILE})")
        manifest = json.loads(manifest_file.read_text())
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{manifest_file}: format {manifest.get('format')!r}, expected {FORMAT!r}")
        if model_path is not None:
            check_model(manifest, model_path, root)
        tensors = load_file(str(root / WEIGHTS_FILE))
        manifest = {k: v for k, v in manifest.items() if k != "format"}
        return cls(**tensors, manifest=manifest)


def check_model(manifest: dict[str, Any], model_path: str | Path, where: str | Path = "estimator") -> None:
    """Refuse (EstimatorMismatch) an estimator not trained for ``model_path``. A manifest that records
    the config hash says which differs, the config (other architecture: the features mean something
    else) or only the weights; a manifest from before config hashes is judged by the fingerprint
    alone (it covers config.json too)."""
    name = manifest.get("model_name")
    recorded_config = manifest.get("config_hash")
    if recorded_config is not None:
        actual_config = config_hash(model_path)
        if recorded_config != actual_config:
            raise EstimatorMismatch(
                f"GateSight estimator {where} was trained for model {name!r}, whose config.json differs from "
                f"{model_path}'s (config hash {str(recorded_config)[:12]} vs {actual_config[:12]}); "
                f"train one with: {train_command(model_path)}"
            )
    fingerprint = model_fingerprint(model_path)
    if manifest.get("model_fingerprint") != fingerprint:
        same_config = "the same config.json but other weights: " if recorded_config is not None else ""
        raise EstimatorMismatch(
            f"GateSight estimator {where} was trained for model {name!r} ({same_config}"
            f"fingerprint {str(manifest.get('model_fingerprint'))[:12]}), not for {model_path} "
            f"(fingerprint {fingerprint[:12]}); train one with: {train_command(model_path)}"
        )


def find_estimator(model_path: str | Path, search_roots: list[Path] | None = None) -> Path:
    """The estimator folder trained for ``model_path``: ``<model>/gatesight`` first, then every
    ``weights/gatesight/*`` whose manifest names this model's fingerprint (and, when it records
    one, its config hash)."""
    from sglang_kvx.models.demo import weights_root

    candidates = [Path(model_path) / "gatesight"]
    for root in search_roots or [weights_root() / "gatesight"]:
        candidates += sorted(p for p in Path(root).glob("*") if p.is_dir())
    fingerprint = model_fingerprint(model_path)
    config = config_hash(model_path)
    near = []  # trained for this config, other weights: worth naming in the refusal
    for candidate in candidates:
        manifest_file = candidate / MANIFEST_FILE
        if not manifest_file.is_file():
            continue
        manifest = json.loads(manifest_file.read_text())
        if manifest.get("model_fingerprint") == fingerprint and manifest.get("config_hash", config) == config:
            return candidate
        if manifest.get("config_hash") == config:
            near.append(str(candidate))
    others = f" ({', '.join(near)} fit this config but were trained on other weights)" if near else ""
    raise EstimatorMismatch(
        f"no GateSight estimator was trained for {model_path}{others}; train one with: "
        f"{train_command(model_path)} (or pass --kvx-estimator DIR)"
    )
