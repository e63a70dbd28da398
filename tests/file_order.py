"""The order tests run in, and which tests pytest-xdist runs together on one worker.

Server starts are much of the suite's time (~13 s each alone, ~14-18 s beside the other worker), and
a worker's pool keeps three servers: a server asked for again after three others were started in
between is started again. So the unit of work is a *server group*: the tests that use one shared
configuration, from whichever file, run one after another on one worker. The files that enumerate
every mode (the combination matrix, request isolation, hostile input, SGLang's fields) give each
mode's test to the group of that mode's server, so the matrix's sparse row runs beside the sparse
file while that server is up. The longest groups go first, so that no long unit starts last and
keeps one worker busy while the other idles. A test in no group runs with the rest of its file.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

# (group, the tests in it as patterns over "file::test[params]"), longest first (seconds summed from
# --durations). The compacting servers, which nearly every group uses too, are the pool's "hot"
# ones: the last stopped for room.
SERVER_GROUPS = (
    # the learned-gate checkpoints evicting by their gates (gated_spec), and the graph emulation's gate cell
    ("gate", ("test_combinations.py::*[[]gated[]]", "test_gpu_defaults.py::test_the_learned_gate_family_*",
              "test_gate_eviction_e2e.py::*")),
    # the recomputing hybrid and the compacting servers
    ("recomputing", ("test_attention_backends.py::*", "test_compaction_e2e.py::*", "test_oda_e2e.py::*",
                     "test_policy_registry_e2e.py::*", "test_schemathesis.py::*")),
    # the GPU-defaults servers (graphs emulated, overlap) beside the compacting ones
    ("gpu", ("test_gpu_defaults.py::*",)),
    # learned-gate cells with per-request decode steps (the gated_cell kind)
    ("cells", ("test_hostile_input.py::*[[]gated_cell-*", "test_head_eviction_e2e.py::*")),
    ("sparse", ("test_combinations.py::*[[]sparse[]]", "test_request_isolation.py::*[[]sparse[]]",
                "test_sparse_attention_e2e.py::*")),
    ("plain", ("test_combinations.py::*[[]plain[]]", "test_hostile_input.py::*[[]plain-*", "test_server_e2e.py::*")),
    ("chunked", ("test_combinations.py::*[[]chunked[]]", "test_compaction_e2e.py::test_a_kvzip_child_sent_before_*",
                 "test_chunked_prefill_e2e.py::*", "test_frontend_and_openai.py::*",
                 "test_sglang_truth_e2e.py::test_a_chunked_childs_usage",
                 "test_sglang_truth_e2e.py::test_prompts_of_two_salts_never_make_one_auto_context")),
    ("tiered", ("test_sglang_truth_e2e.py::test_children_restored_from_host_memory_*", "test_host_tier_e2e.py::*")),
    ("paged", ("test_paged_kv_e2e.py::*", "test_combinations.py::*[[]paged[]]")),
    # the dense Qwen3 server: served like HF, and refusing KVzap for want of a surrogate
    ("qwen3", ("test_qwen3_dense.py::*", "test_kvzap_e2e.py::test_a_model_without_a_surrogate_*")),
)
# Files with servers of their own (or long fresh processes), longest first, after the groups;
# unlisted files follow in their collection order.
FILE_ORDER = (
    "test_context_dir_e2e.py", "test_parallel.py", "test_tier_soak.py", "test_server_process.py", "test_qwen3_next.py",
    "test_decode_steps.py", "test_kvzap_e2e.py", "test_smollm2.py", "test_admission_stalls.py",
)


def unit(nodeid: str) -> str:
    """The work unit of a test: its server group, else its file (``tests/test_x.py``)."""
    path, _, rest = nodeid.partition("::")
    name = f"{path.rsplit('/', 1)[-1]}::{rest}"
    return _placed(name)[0] or path


def _placed(name: str) -> tuple[str, int, int]:
    """(group, its place, the first pattern's place in it) of ``file::test[params]``; ("", ...) in none. A
    test's most specific pattern wins: a pattern naming a test before one naming a whole file."""
    matches = [(pattern.endswith("::*"), g, p, group) for g, (group, patterns) in enumerate(SERVER_GROUPS)
               for p, pattern in enumerate(patterns) if fnmatchcase(name, pattern)]
    if not matches:
        return "", len(SERVER_GROUPS), 0
    _, g, p, group = min(matches)
    return group, g, p


def rank(nodeid: str) -> tuple[int, int]:
    """Sort key of a test: its group's place and, within the group, its pattern's (the tests of one server
    adjacent: a group's first patterns are the tests whose servers its later ones stop for room), else
    its file's place in FILE_ORDER (unlisted files last)."""
    path, _, rest = nodeid.partition("::")
    file_name = path.rsplit("/", 1)[-1]
    group, g, p = _placed(f"{file_name}::{rest}")
    if group:
        return g, p
    return len(SERVER_GROUPS) + (FILE_ORDER.index(file_name) if file_name in FILE_ORDER else len(FILE_ORDER)), 0


def make_file_group_scheduler(config, log):
    """pytest-xdist's ``--dist loadfile``, where a work unit is a server group or a file (``unit``).

    Only the unit changes (``_split_scope``): pytest-xdist's own ``--dist loadgroup`` reads
    ``xdist_group`` markers from ``item._nodeid``, which pytest 9 no longer uses for node ids, so
    it silently fell back to spreading single tests over the workers."""
    from xdist.scheduler import LoadFileScheduling  # only under pytest-xdist

    class FileGroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit(nodeid)

    return FileGroupScheduling(config, log)
