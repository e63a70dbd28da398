"""The counter behind issue #56's host-sync figures (sglang_kvx/ops/host_syncs.py, perf/count_host_syncs.py):
each call that would make a GPU wait for the host counts once, by kind; what runs on the device alone
counts nothing."""

from __future__ import annotations

import torch

from sglang_kvx.ops.host_syncs import HostSyncCounter, device_positions


def test_each_waiting_call_counts_once_by_kind_and_device_work_counts_nothing():
    a = torch.arange(10)
    with HostSyncCounter() as counter:
        # on the device alone: arithmetic, gathers by index, sized repeats, slicing
        b = (a * 2 + 1)[a[:3]]
        a.repeat_interleave(a, output_size=45)
        a.repeat_interleave(2)
        torch.where(a > 3, a, -a)
        a[2:5].sum()
    assert counter.total == 0, dict(counter.counts)
    with HostSyncCounter() as counter:
        a.sum().item()
        int(a[0])
        a.tolist()
        bool(a[0] > 1)
        a.cpu()
        a[a > 3]
        torch.nonzero(a)
        a.unique()
        torch.tensor([1, 2])
        a.repeat_interleave(a)
    assert dict(counter.counts) == {"item": 2, "tolist": 1, "bool": 1, "cpu": 1, "bool_index": 1, "nonzero": 1,
                                    "unique": 1, "tensor_from_host": 1, "repeat_interleave": 1}
    assert counter.total == 10 and b.shape == (3,)


def test_host_positions_reach_the_device_as_aranges_with_nothing_copied():
    import random

    rng = random.Random(0)
    cases = [[], [4], [0, 1, 2, 3], [3, 1], [0, 2, 3, 7]] + [
        sorted(rng.sample(range(16), rng.randint(1, 16))) for _ in range(20)]
    for positions in cases:
        with HostSyncCounter() as counter:
            index = device_positions(positions, "cpu")
        assert counter.total == 0, (positions, counter.counts)
        assert index.dtype == torch.long and index.tolist() == positions
