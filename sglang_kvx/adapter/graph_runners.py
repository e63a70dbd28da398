"""The emulated graph runners (``graph_replay.py`` says what they reproduce and what not).

Each subclasses SGLang's own runner and keeps its eligibility code (``can_run_graph``, the
hidden-state check), setting the facts that code reads as SGLang's constructor does, without
capturing anything; ``execute`` replays by running the eager forward inside ``replay_scope``.
Installed in place of SGLang's runners by AROUND hooks on ``capture_decode_graph`` and (as the class
``capture_prefill_graph`` builds) ``PrefillCudaGraphRunner``, on the CPU platform only.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack

from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.cuda_graph_config import Backend
from sglang.srt.model_executor.runner.base_cuda_graph_runner import get_batch_sizes_to_capture
from sglang.srt.model_executor.runner.base_runner import BaseRunner
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import (
    PrefillCudaGraphRunner, get_prefill_num_tokens_to_capture)
from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import enable_breakable_cuda_graph
from sglang.srt.model_executor.runner_utils.capture_mode import (
    _set_capture_attention_variant, get_capture_attention_variant)
from sglang.srt.model_executor.runner_utils.forward_batch import set_forward_batch
from sglang.srt.model_executor.runner_utils.prefill_graph import prefill_graph_scope
from sglang.srt.runtime_context import get_exec, get_parallel, get_spec

from sglang_kvx.adapter.attention import page_table_reader
from sglang_kvx.adapter.graph_replay import DECODE, PREFILL, replay_scope
from sglang_kvx.adapter.graph_tables import install_page_table_graphs

logger = logging.getLogger(__name__)


class EmulatedDecodeGraph(DecodeCudaGraphRunner):
    """A full decode graph per captured batch size (and attention variant); a replay runs the whole forward with
    no Python of ours. A backend whose kernel reads page tables gets the page-table variant (``graph_tables.py``)."""

    def __init__(self, model_runner) -> None:
        BaseRunner.__init__(self, model_runner)
        # What DecodeCudaGraphRunner.__init__ sets of the facts its can_run_graph reads.
        self.record_nolora_graph = False
        self.disable_padding = get_exec().graph.disable_cuda_graph_padding
        self.is_encoder_decoder = model_runner.model_config.is_encoder_decoder
        self.require_mlp_tp_gather = self.require_attn_tp_gather = False
        self.require_gathered_buffer = False
        self.require_mlp_sync = get_parallel().attn_dp_enabled
        self.enable_two_batch_overlap = get_exec().overlap.enable_two_batch_overlap
        self.speculative_algorithm = get_spec().speculative_algorithm
        self.attn_backend = model_runner.attn_backend
        self.captured_req_width = 1
        self.ragged_verify_mode = False
        self.attention_graph_variants = None
        self.capture_bs, self.compile_bs = get_batch_sizes_to_capture(model_runner, 1, gathered_buffer_required=False)
        self.max_bs = max(self.capture_bs)
        self.max_num_token = self.max_bs
        self.capture_hidden_mode = self.return_hidden_states_mode
        # SGLang's capture asks the backend for its graph state first (torch-native backends refuse).
        self.attn_backend.init_cuda_graph_state(self.max_bs, self.max_num_token)
        reader = page_table_reader(self.attn_backend)
        if reader is not None:
            layers = [m for m in model_runner.model.modules() if isinstance(m, RadixAttention)]
            self.attention_graph_variants = install_page_table_graphs(reader, self.max_bs, layers)
        self.replays = 0
        self.variant_replays: dict[str, int] = {}
        logger.info("sglang_kvx: emulated decode graphs (CPU) for batch sizes %s", self.capture_bs)

    def execute(self, forward_batch, pp_proxy_tensors=None):
        self._validate_capture_hidden_mode(forward_batch)  # SGLang's load_batch refuses more hidden states
        variant = self._resolve_attention_variant(forward_batch, forward_batch.batch_size)  # SGLang's replay asks
        self.replays += 1
        if variant is not None:
            self.variant_replays[variant] = self.variant_replays.get(variant, 0) + 1
        before = get_capture_attention_variant()
        _set_capture_attention_variant(variant)  # the label SGLang's capture set while recording this graph
        try:
            with replay_scope(DECODE, self.model_runner.model):
                return self.model_runner.eager_runner.execute(forward_batch, pp_proxy_tensors=pp_proxy_tensors)
        finally:
            _set_capture_attention_variant(before)


class EmulatedPrefillGraph(PrefillCudaGraphRunner):
    """A breakable prefill graph per token bucket; a replay runs the decoder stack with no Python of ours
    but the attention and GDN backends' forwards (SGLang's eager bodies)."""

    def __init__(self, model_runner) -> None:
        BaseRunner.__init__(self, model_runner)
        prefill = get_exec().graph.cuda_graph_config.prefill
        if prefill.backend != Backend.BREAKABLE:
            raise NotImplementedError(f"the CPU graph emulation replays breakable prefill graphs, not {prefill.backend!r}")
        attn = model_runner.attn_backend
        # What PrefillCudaGraphRunner.__init__ sets of the facts can_run_graph / can_replay_locally read.
        self.dllm_attention = getattr(attn, "dllm_attention", None)
        self._backend_can_run_prefill_cuda_graph = getattr(attn, "can_run_prefill_cuda_graph", None)
        self._fa4_prefill = False
        self.enable_lora = model_runner.lora_manager is not None
        self._capture_lora = False
        self.prefill_backend_name = prefill.backend
        self._qwen_bcg_hc_sidechannel = self._qwen_bcg_mtp_draft = False
        self.prefer_eager_mixed_prefill = False
        self.capture_num_tokens = get_prefill_num_tokens_to_capture(prefill.bs)
        self.max_num_tokens = max(self.capture_num_tokens)
        self.max_bs = model_runner.req_to_token_pool.size
        self.max_context_size = prefill.max_context_size
        self.max_seq_len = prefill.max_seq_len
        if self.max_seq_len is None:
            self.max_seq_len = getattr(attn, "prefill_cuda_graph_default_max_seq_len", None)
        self.capture_hidden_mode = self.return_hidden_states_mode
        self.has_mha_companion_layers = False
        self._is_full_backend = False
        self._capture_req_slots = 1
        self.enable_cp_bcg_capture = False
        self._capture_chunked_prefix = False
        self.raw_num_tokens = self.raw_bs = 0
        self.replays = 0
        logger.info("sglang_kvx: emulated breakable prefill graphs (CPU) up to %d tokens", self.max_num_tokens)

    def execute(self, forward_batch, **kwargs):
        self._validate_capture_hidden_mode(forward_batch)
        self.replays += 1
        num_tokens = int(forward_batch.input_ids.shape[0])
        with ExitStack() as stack:
            # SGLang's own graph flags: its layers send attention and GDN layers through the eager bodies.
            stack.enter_context(set_forward_batch(forward_batch))  # what the eager bodies read (SGLang's replay sets it)
            stack.enter_context(prefill_graph_scope(full_graph=False, raw_num_tokens=num_tokens))
            stack.enter_context(enable_breakable_cuda_graph())
            stack.enter_context(replay_scope(PREFILL, self.model_runner.model))
            return self.model_runner.eager_runner.execute(forward_batch)


def around_capture_decode_graph(original, *args, model_runner, **kwargs):
    """SGLang's decode capture skips CPU devices; under the emulation its decode graphs are emulated
    wherever SGLang would capture them on CUDA (a target model, decode graphs not disabled)."""
    from sglang.srt.model_executor.cuda_graph_config import Phase, check_cuda_graph_backend
    from sglang.srt.model_executor.model_runner_components.cuda_graph_setup import GraphCapture

    if (model_runner.is_draft_worker or not model_runner.is_generation or model_runner.spec_algorithm.is_speculative()
            or check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED)):
        return original(*args, model_runner=model_runner, **kwargs)
    return GraphCapture(runner=EmulatedDecodeGraph(model_runner), memory_phase="decode", memory_usage_gb=0,
                        capture_time=0)


def graph_replays(model_runner) -> dict[str, int]:
    """How many batches each emulated runner replayed (absent: none installed), and of them each attention
    graph variant (``decode[kvx_page_tables]``)."""
    counts = {}
    for kind, runner in ((DECODE, model_runner.decode_cuda_graph_runner), (PREFILL, model_runner.prefill_cuda_graph_runner)):
        if isinstance(runner, (EmulatedDecodeGraph, EmulatedPrefillGraph)):
            counts[kind] = runner.replays
        for variant, replays in getattr(runner, "variant_replays", {}).items():
            counts[f"{kind}[{variant}]"] = replays
    return counts
