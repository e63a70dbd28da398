"""GateSight's per-(attention layer, KV head) utility estimators: weights, manifest, scoring.

Each estimator is a one-hidden-layer MLP (64 units, ReLU) on the standardised features of
``gatesight.features``. All of a model's estimators live in one safetensors file as stacked
tensors, with a manifest naming the model they were trained for; loading them for another
model is refused (the features would mean something else).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sglang_kvx.ops.gatesight import mlp_utility

FORMAT = "sglang_kvx.gatesight/1"
WEIGHTS_FILE = "estimator.safetensors"
MANIFEST_FILE = "manifest.json"
_FINGERPRINT_SAMPLE = 1 << 20  # bytes hashed from each end of a weights file


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
    fingerprint = model_fingerprint(model_path)
    if manifest.get("model_fingerprint") != fingerprint:
        raise EstimatorMismatch(
            f"GateSight estimator {where} was trained for model {manifest.get('model_name')!r} "
            f"(fingerprint {str(manifest.get('model_fingerprint'))[:12]}), not for {model_path} "
            f"(fingerprint {fingerprint[:12]}); train one with: python -m sglang_kvx.training.train_gatesight --model {model_path}"
        )


def find_estimator(model_path: str | Path, search_roots: list[Path] | None = None) -> Path:
    """The estimator folder trained for ``model_path``: ``<model>/gatesight`` first, then every
    ``weights/gatesight/*`` whose manifest names this model's fingerprint."""
    from sglang_kvx.models.demo import weights_root

    candidates = [Path(model_path) / "gatesight"]
    for root in search_roots or [weights_root() / "gatesight"]:
        candidates += sorted(p for p in Path(root).glob("*") if p.is_dir())
    fingerprint = model_fingerprint(model_path)
    for candidate in candidates:
        manifest_file = candidate / MANIFEST_FILE
        if manifest_file.is_file() and json.loads(manifest_file.read_text()).get("model_fingerprint") == fingerprint:
            return candidate
    raise EstimatorMismatch(
        f"no GateSight estimator was trained for {model_path}; train one with: "
        f"python -m sglang_kvx.training.train_gatesight --model {model_path} (or pass --kvx-estimator DIR)"
    )
