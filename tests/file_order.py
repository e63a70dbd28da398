"""The order test files run in, and which files pytest-xdist runs on one worker.

Server starts are most of the suite's time (~30 s each), so the files that use a server few others
use run on one worker, one after another, and that server starts once for all of them; the longest
groups go first, so that no long file starts last and keeps one worker busy while the other idles.
"""

from __future__ import annotations

from pathlib import Path

# Longest groups first (seconds summed from --durations); within a group, files using the same
# servers adjacent. Unlisted files follow in their collection order.
FILE_ORDER = (
    # "cells": the learned-gate cells, the sparse and plain servers, and the files that use them too
    "test_head_eviction_e2e.py", "test_sparse_attention_e2e.py", "test_request_isolation.py", "test_server_e2e.py",
    "test_chunked_prefill_e2e.py", "test_frontend_and_openai.py",
    # "recomputing": the recomputing hybrid and the compacting dense server
    "test_attention_backends.py", "test_compaction_e2e.py", "test_oda_e2e.py", "test_policy_registry_e2e.py",
    "test_schemathesis.py",
    # one file each, with servers of their own
    "test_parallel.py", "test_context_dir_e2e.py", "test_tier_soak.py", "test_host_tier_e2e.py", "test_gate_eviction_e2e.py",
    "test_qwen3_next.py", "test_paged_kv_e2e.py", "test_smollm2.py", "test_qwen3_dense.py",
)
GROUPS = {name: "cells" for name in FILE_ORDER[:6]} | {name: "recomputing" for name in FILE_ORDER[6:11]}


def rank(path: Path) -> int:
    """Sort key of a test file: its place in FILE_ORDER (unlisted files after, in their order)."""
    return FILE_ORDER.index(path.name) if path.name in FILE_ORDER else len(FILE_ORDER)


def make_file_group_scheduler(config, log):
    """pytest-xdist's ``--dist loadfile``, where a work unit is a file or a whole GROUPS group.

    Only the unit changes (``_split_scope``): pytest-xdist's own ``--dist loadgroup`` reads
    ``xdist_group`` markers from ``item._nodeid``, which pytest 9 no longer uses for node ids, so
    it silently fell back to spreading single tests over the workers."""
    from xdist.scheduler import LoadFileScheduling  # only under pytest-xdist

    class FileGroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return GROUPS.get(Path(path).name, path)

    return FileGroupScheduling(config, log)
