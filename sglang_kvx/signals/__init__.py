"""The signal layer: what one prefill of a context exposes to a policy (``base.ContextSignals``), and
each signal as one registered unit (``base.Signal``) in its own file; importing this package
registers the shipped ones. A signal registered elsewhere (``@register_signal`` in a policy module
loaded with ``--kvx-policy-modules``) is captured and filled the same way."""

from sglang_kvx.signals.base import (  # noqa: F401
    SIGNALS,
    CaptureSpec,
    ChunkScoring,
    ContextSignals,
    GDNLayerSignals,
    QueryChunk,
    QueryStatistics,
    ReferenceLayer,
    Signal,
    capture_for,
    gather_heads,
    gdn_layers_before,
    get_signal,
    rank_kv_heads,
    register_signal,
)

# Importing a signal module registers it.
from sglang_kvx.signals import column_sums, gdn, output_gate, pass_queries, query_statistics, window  # noqa: F401,E402
from sglang_kvx.signals import hidden_states  # noqa: F401,E402
