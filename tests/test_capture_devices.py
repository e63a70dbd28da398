"""Every tensor a capture path makes lives on the device of its inputs (no CPU tensor meets a GPU one).

No GPU here: the "meta" device stands in. A CPU-made tensor meeting a meta one raises, and a result
left on CPU is seen, exactly where a CPU tensor would meet a CUDA one.
"""

from __future__ import annotations

import torch

from sglang_kvx.policies.h2o import add_column_sums
from sglang_kvx.policies.kvzip import accumulate_reconstruction_attention
from sglang_kvx.policies.snapkv import observation_window_attention
from sglang_kvx.ports import Segment
from sglang_kvx.signals import CaptureSpec
from sglang_kvx.signals.recorder import SignalRecorder

META = torch.device("meta")


def test_policy_maths_stays_on_its_inputs_device():
    queries, keys = torch.empty(7, 4, 8, device=META), torch.empty(12, 2, 8, device=META)
    sums = torch.zeros(4, 12, device=META)
    add_column_sums(sums, queries, keys, scaling=0.3, first_position=5)
    assert sums.device == META
    assert observation_window_attention(torch.empty(4, 3, 8, device=META), torch.empty(2, 12, 8, device=META)).device == META
    total = torch.zeros(2, 10, device=META)
    accumulate_reconstruction_attention(total, torch.empty(4, 6, 8, device=META), torch.empty(2, 16, 8, device=META), 2, 9,
                                        protected_prefix_len=2)
    assert total.device == META


class _Batch:
    is_extend, is_decode = True, False

    def __init__(self, segments):
        self.segments = segments
        self.rows = [s.row for s in segments]


class _MetaPool:
    num_layers, num_kv_heads, head_dim = 2, 2, 8

    def row(self, row, length):
        return torch.arange(length, device=META)

    def read_keys(self, layer, slots):
        return torch.empty(slots.shape[0], 2, 8, device=META)


def test_recorder_keeps_captures_on_the_forward_device():
    recorder = SignalRecorder(_MetaPool(), num_q_heads=4, rope_inv_freq=lambda: torch.ones(4))
    recorder.start(3, n=10, spec=CaptureSpec(window=4, column_sums=True, output_gate=True))
    batch = _Batch([Segment(index=0, row=3, start=0, length=6, prefix_len=4)])
    recorder.attention(0, torch.empty(6, 4 * 8, device=META), batch, num_q_heads=4, head_dim=8, scaling=0.35)
    recorder.output_gate(0, torch.empty(6, 4 * 8, device=META), batch, 4)
    recording = recorder.take(3)
    assert recording.state("window").queries[0].device == META
    assert recording.state("column_sums").sums[0].device == META
    assert recording.state("output_gate")["sums"][0][0].device == META
