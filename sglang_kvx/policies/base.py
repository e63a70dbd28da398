"""The policy interface and its registry (a small factory, like SGLang's backend registries).

A policy turns one prefilled context's signals into a utility per (attention layer, KV head,
entry): ``score(signals, layer) -> [num_kv_heads, n]``, higher = keep. How many entries each
layer keeps is the allocation's job (``sglang_kvx.allocate``, named by ``allocation``), which
entries the selection's (``sglang_kvx.select``: per head top-K plus the protected prefix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from sglang_kvx.signals import CaptureSpec, ChunkScoring, ContextSignals, capture_for


@dataclass(frozen=True)
class ModelTraits:
    """What a model can offer a policy, read from its config before any weights load."""

    architecture: str
    num_attention_layers: int
    num_kv_heads: int
    has_gdn: bool  # Gated-DeltaNet layers: write gates, decay, write magnitudes
    has_output_gate: bool  # gated full attention (Qwen3.5 / Qwen3-Next)
    attention_layer_ids: tuple[int, ...] = ()  # model layer index of each full-attention layer
    gdn_layer_ids: tuple[int, ...] = ()  # model layer index of each GDN layer
    gated_attention: str = ""  # "softmax" | "sigmoid": the learned-gate family, which computes its own attention
    learned_gates: bool = False  # ... and its layers write a gate with every entry ("learned_gates")

    @property
    def signals(self) -> frozenset[str]:
        if self.gated_attention:
            # Its attention runs in its own op, not SGLang's backends: none of the signals recorded
            # there. The op hands a decode step its attention weights -- offered on the dense cells,
            # where the per-head baselines (online H2O, KeyDiff) run as the paper compares them.
            return frozenset({"learned_gates"} if self.learned_gates else {"decode_attention_weights"})
        # "queries": the context's own query statistics (TriAttention); "reconstruction": KVzip's
        # second, context-repeating pass; "hidden_states": each attention layer's input (KVzap).
        # Any attention model can produce them.
        signals = {"keys", "values", "attention", "queries", "reconstruction", "hidden_states"}
        if self.has_gdn:
            signals.add("gdn")
        if self.has_output_gate:
            signals.add("output_gate")
        return frozenset(signals)


@dataclass
class PassLayer:
    """One attention layer of one finished second pass, as ``SecondPass.accumulate`` reads it."""

    layer: int  # attention-layer index
    queries: torch.Tensor  # [Hq, m, D]: the pass's queries (after RoPE)
    keys: torch.Tensor  # [Hkv, n + m, D]: the context's keys, then the pass's own
    scaling: float  # the layer's softmax scale
    values: Callable[[], torch.Tensor]  # () -> [Hkv, n + m, D], read from the pool only when asked
    recording: Any  # the pass's recording: every signal ``SecondPass.capture()`` named (``recording.state(name)``)
    kv_heads: tuple[int, int] | None = None  # under tensor parallelism: the model's KV heads this rank holds


class SecondPass:
    """How a policy scores a context by further forwards over it (``KVPolicy.second_pass``; KVzip's
    reconstruction is one). The runtime (``compact/second_pass.py``) holds the parent's full KV,
    queues one internal child of it per pass (``passes``: context ids + the pass's own), records
    what ``capture()`` names inside each pass, folds each pass's layers into per-layer totals
    (``accumulate``), and compacts with ``ContextSignals.<signal>`` set to those totals. The runtime
    uses the policy instance's ``second_pass`` (built by ``from_config``, so it may hold model resources)."""

    signal: ClassVar[str] = ""  # the ContextSignals field the totals fill

    def capture(self) -> CaptureSpec:
        """What each pass records inside its forward (default: its queries)."""
        return CaptureSpec(pass_queries=True)

    def prompt_ids(self, tokenizer: Any) -> Any:
        """Token ids the passes are built from (computed once per server, from its tokenizer)."""
        raise NotImplementedError

    def passes(self, context_ids: list[int], prompt: Any, protected_prefix_len: int) -> list[tuple[int, int, list[int]]]:
        """(start, end, pass ids): each pass's chunk [start, end) of the context and its own tokens."""
        raise NotImplementedError

    def longest_pass(self, n: int, prompt: Any, protected_prefix_len: int) -> int:
        """Tokens of the longest pass over an ``n``-token context (it must fit the context length beside it)."""
        raise NotImplementedError

    def accumulate(self, total: torch.Tensor, layer: PassLayer, start: int, end: int, *, protected_prefix_len: int) -> None:
        """Fold one pass of one attention layer into ``total`` [kv_heads, n]."""
        raise NotImplementedError


class KVPolicy:
    """Base class. ``needs`` names the signals a policy reads; a model lacking one is refused.

    A policy carries its own facts, and the server, the flags, validation, ``/kvx/stats`` and the
    tests read them from here (the registry is the only list of policies): ``needs`` (signals),
    ``captures()`` (what the server records inside the prefill for it), ``tp_unsafe`` (why it is
    not rank-consistent under tensor parallelism, "" when it is), ``second_pass`` (it is scored
    by internal reconstruction requests after the prefill), ``from_config`` (how a server builds it).

    Subclasses take their options as keyword arguments with their paper's defaults
    (``get_policy("snapkv")(window_size=32)``). Policies that need an extra model pass
    (KVzip's reconstruction, TriAttention's statistics) fit the same shape: the producer
    adds their signal to ``ContextSignals`` and its name to ``ModelTraits.signals``, and
    ``score`` still maps (signals, layer) to [num_kv_heads, n].
    """

    name: ClassVar[str] = ""
    needs: ClassVar[frozenset[str]] = frozenset()
    # False only for ``none``: the server then behaves exactly as plain SGLang.
    compacts: ClassVar[bool] = True
    # Why it is not rank-consistent under --tp-size > 1 ("" = it is: scores and budgets per local KV head).
    tp_unsafe: ClassVar[str] = ""
    # False for a policy that scores offline only (the HF oracle, choose_keep_set): the server refuses it.
    served: ClassVar[bool] = True
    # Scored by the server's internal reconstruction requests after the prefill (KVzip), not at release.
    second_pass: ClassVar[SecondPass | None] = None
    # The layer-budget rule used unless the caller picks another (a name in sglang_kvx.allocate).
    allocation: ClassVar[str] = "flat"

    @classmethod
    def from_config(cls, config: Any) -> "KVPolicy":
        """The instance a server applies (``config``: its ``KvxConfig``); paper defaults unless overridden."""
        return cls()

    def captures(self) -> CaptureSpec:
        """What the server records for this policy inside a parent's prefill (keys and values are read
        from the pool afterwards). Attention-reading policies override it with their window."""
        return capture_for(self.needs)

    def chunk_scoring(self) -> ChunkScoring | None:
        """For a policy whose score of an entry reads only that token's own signals: how the server
        scores each prefill chunk as it runs, holding scores instead of the context's signals
        (``signals.ChunkScoring``). None, the default: scored once, after the prefill."""
        return None

    @property
    def allocation_options(self) -> dict[str, Any]:
        """Keyword options this policy passes to its allocation (PyramidKV's beta)."""
        return {}

    def under(self, allocation: str) -> "KVPolicy":
        """The policy that scores a context served under ``allocation`` (a name in
        ``sglang_kvx.allocate``). Itself, unless its rule depends on the allocation (KVzap's window
        belongs to its threshold rule, not to a budget)."""
        return self

    def score_layers(self, signals: ContextSignals, budgets: list[int]) -> list[torch.Tensor]:
        """Every layer's scores; a policy that scores all layers in one batched op overrides this."""
        return [self.score(signals, layer, budget=budget) for layer, budget in enumerate(budgets)]

    def score(self, signals: ContextSignals, layer: int, budget: int | None = None) -> torch.Tensor:
        """Utility of every entry of attention layer ``layer``: float [num_kv_heads, n], higher = keep.

        ``budget`` is how many entries beyond the protected prefix this layer will keep; selection
        passes it, and only a policy whose ranking depends on it (H2O's recent half) reads it.
        """
        raise NotImplementedError(f"KV policy {self.name!r} does not score entries")

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


def servable_policy_names() -> list[str]:
    """The policies a request or ``--kvx-policy`` may name to compact a context."""
    return sorted(name for name, cls in POLICIES.items() if cls.compacts and cls.served)


def get_policy(name: str) -> type[KVPolicy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown --kvx-policy {name!r}; valid choices: {', '.join(policy_names())}"
        ) from None


# Helpers shared by the policy files.


def check_layer(signals: ContextSignals, layer: int) -> None:
    if not 0 <= layer < signals.num_layers:
        raise ValueError(f"attention layer {layer} out of range: the context has {signals.num_layers} attention layers")


def layer_signal(signals: ContextSignals, field_name: str, layer: int, policy: str) -> torch.Tensor:
    """``signals.<field_name>[layer]``, or a clear error naming what the producer left out."""
    check_layer(signals, layer)
    per_layer = getattr(signals, field_name)
    if per_layer is None:
        raise ValueError(f"KV policy {policy!r} needs ContextSignals.{field_name}, which this prefill did not produce")
    return per_layer[layer]
