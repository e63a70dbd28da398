"""Whether a forward batch may replay a captured graph, from what its rows' policies and steps declare.

On CUDA SGLang replays captured graphs (a decode graph: the whole forward; a breakable prefill graph:
everything but the attention and GDN backends' forwards), and a replay runs none of the plugin's Python:
no hook, no recorder, no mask. A batch therefore runs eagerly whenever one of its rows needs the plugin
inside the forward. ``eager_reason`` says which need, for decode and prefill graphs alike; the adapter's
``around_can_run_graph`` asks it after SGLang's own answer, and is the only place that declines. It
names no policy or step: each declares what it needs (``KVPolicy.captures``: a recording;
``DecodeStep.forward_outputs``, ``reads_attention``, ``reads_attention_inputs``; a step's span, drops
and per-head cells; a child's per-layer lengths), so a new one needs no edit here. Every other batch --
plain rows, children of flat contexts, decode steps running Full -- keeps its graph. Where the decode
graphs carry page tables (``tables_in_graph``: a backend whose kernel reads them, ``adapter/graph_tables.py``),
children reading per-layer lengths and decode-step spans keep theirs too: what they read is a table then,
filled before the replay. A breakable prefill graph runs the attention backend's forward outside its
captured pieces, so a child's extend (its question) replays one whatever its layers read.
"""

from __future__ import annotations

from typing import Any

from sglang_kvx.decode.row_state import FINAL_HIDDEN
from sglang_kvx.ports import Batch

SPARSE = "block-sparse attention"
RECORDING = "a parent recording its signals"
PER_LAYER = "a child reading per-layer lengths"
HIDDEN = "hidden states beyond the graph's capture mode"
STEP_OUTPUTS = "a decode step reading the forward's final hidden states"
STEP_INSIDE = "a decode step reading inside the forward"
STEP_SPAN = "a decode step hiding part of a row"


def eager_reason(runtime: Any, batch: Batch, hidden_captured: bool, hidden_beyond: bool = False,
                 tables_in_graph: bool = False, attention_in_replay: bool = False) -> str | None:
    """Why ``batch`` must run eagerly (None: it may replay a graph). ``hidden_captured``: the graph captures
    final hidden states; ``hidden_beyond``: the batch asks for more hidden states than it captured;
    ``tables_in_graph``: the graph reads each layer's page table (rows reading other than their whole row);
    ``attention_in_replay``: the replay runs the attention backend's forward as Python (a breakable
    prefill graph), which plans what each row reads as an eager forward does."""
    if runtime.config.sparse_budget:
        return SPARSE  # the block-sparse ops: blocks planned per batch, but their shapes (blocks, choices) vary per batch
    if batch.is_extend and any(row in runtime.recorder.recordings for row in batch.rows):
        return RECORDING  # its signals are taken from inside every layer
    if not (tables_in_graph or attention_in_replay) and runtime.admission.rows.needs_per_layer_lengths(batch):
        return PER_LAYER
    if runtime.decode and (reason := _decode_reason(runtime.decode, batch, hidden_captured, tables_in_graph)) is not None:
        return reason
    return HIDDEN if hidden_beyond else None  # asked by someone else (a client's return_hidden_states)


def _decode_reason(decode: Any, batch: Batch, hidden_captured: bool, tables_in_graph: bool) -> str | None:
    for row in batch.rows:
        state = decode.rows.get(row)
        if state is None or state.failed:
            continue
        step = state.step
        if FINAL_HIDDEN in step.forward_outputs and not hidden_captured:
            return STEP_OUTPUTS
        if step.reads_attention or step.reads_attention_inputs:
            return STEP_INSIDE
        if (batch.is_decode and not tables_in_graph
                and (not state.span.full or any(e > b for b, e in state.dropped) or state.own.masks)):
            return STEP_SPAN
    return None
