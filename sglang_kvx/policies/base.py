"""The policy interface and its registry (a small factory, like SGLang's backend registries)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar


@dataclass(frozen=True)
class ModelTraits:
    """What a model can offer a policy, read from its config before any weights load."""

    architecture: str
    num_attention_layers: int
    num_kv_heads: int
    has_gdn: bool  # Gated-DeltaNet layers: write gates, decay, write magnitudes
    has_output_gate: bool  # gated full attention (Qwen3.5 / Qwen3-Next)

    @property
    def signals(self) -> frozenset[str]:
        signals = {"keys", "values", "attention"}
        if self.has_gdn:
            signals.add("gdn")
        if self.has_output_gate:
            signals.add("output_gate")
        return frozenset(signals)


class KVPolicy:
    """Base class. ``needs`` names the signals a policy reads; a model lacking one is refused."""

    name: ClassVar[str] = ""
    needs: ClassVar[frozenset[str]] = frozenset()
    # False only for ``none``: the server then behaves exactly as plain SGLang.
    compacts: ClassVar[bool] = True

    @classmethod
    def check_model(cls, traits: ModelTraits) -> None:
        missing = sorted(cls.needs - traits.signals)
        if missing:
            raise ValueError(
                f"--kvx-policy {cls.name} needs {', '.join(missing)}, which "
                f"{traits.architecture} does not provide"
            )


POLICIES: dict[str, type[KVPolicy]] = {}


def register_policy(name: str) -> Callable[[type[KVPolicy]], type[KVPolicy]]:
    def decorator(cls: type[KVPolicy]) -> type[KVPolicy]:
        if name in POLICIES:
            raise ValueError(f"KV policy {name!r} is already registered")
        cls.name = name
        POLICIES[name] = cls
        return cls

    return decorator


def policy_names() -> list[str]:
    return sorted(POLICIES)


def get_policy(name: str) -> type[KVPolicy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown --kvx-policy {name!r}; valid choices: {', '.join(policy_names())}"
        ) from None
