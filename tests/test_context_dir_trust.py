"""Issue #53 items 2, 3, 5, 6 on the disk tier's real files: the context directory is the server's own,
and every file in it is untrusted.

- A directory holding files the server did not write (a model's folder) is refused at launch and
  nothing in it changes; an operator's files beside the contexts survive every scan, flush and
  least-recently-used pass; a manifest naming another context's tensor file removes only itself.
- A FIFO, a symlink, a hostile manifest (wrong types, huge numbers, deep nesting) never hangs, crashes
  or stops the tier: that file alone is refused.
- A file whose checksum an attacker recomputed is still checked against the pool before a slot is
  taken: another dtype, infinite keys, a NaN or misshapen recurrent-state snapshot are refused, no slot
  leaks, and the child is served by a full prefill with the reason (no machine path in it).
- With ``--kvx-context-secret-file`` a manifest without a valid HMAC is refused.
- The launcher refuses what cannot work: persistence on an unwritable directory, tiers that cannot hold
  one context, host memory beyond the machine's.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from sglang_kvx.compact.layout import fold_layers
from sglang_kvx.config import KvxConfigError, build_config
from sglang_kvx.serve.admission import Admission
from sglang_kvx.serve.plans import CHILD, PLAIN
from sglang_kvx.settings import ServerDefaults
from sglang_kvx.store import ContextStore
from sglang_kvx.store.context_file import MARKER
from test_compactor_views import TensorPool
from test_context_tiers import Budget, Child, admit, stored_context
from test_disk_tier import FINGERPRINT, evict_all

IDS = tuple(range(800, 812))
KEPT = [4, 4, 4]


def server(pool: TensorPool, directory: Path, secret_file: str = "") -> Admission:
    return Admission(pool, ContextStore(), ServerDefaults(
        "knorm", 0.5, 0, frozenset({"keys"}), min_store_fraction=0.0, context_dir=str(directory), disk_store_gb=1.0,
        model_fingerprint=FINGERPRINT, context_secret_file=secret_file), num_rows=4)


def write_context(directory: Path, ids=IDS, pool: TensorPool | None = None, secret_file: str = "") -> tuple[Path, Path]:
    """One context evicted to ``directory`` by a server of its own: (manifest, tensor file)."""
    pool = pool or TensorPool(slots=40)
    admission = server(pool, directory, secret_file)
    stored_context(pool, admission, ids, fold_layers(KEPT), KEPT)
    evict_all(admission, pool)
    admission.eviction.tiering.disk.close()
    manifest = next(p for p in directory.glob("*.json") if json.loads(p.read_text()).get("context_ids") == list(ids))
    raw = json.loads(manifest.read_text())
    return manifest, directory / raw["tensors"]


def tamper(manifest: Path, change) -> None:
    """Rewrite a context's tensors with ``change(tensors)`` and make the file set consistent again, as a
    writer of the directory could: a new tensor file named by its digest, the manifest's size and SHA-256."""
    from safetensors.torch import load, save

    raw = json.loads(manifest.read_text())
    old = manifest.parent / raw["tensors"]
    tensors = load(old.read_bytes())
    change(tensors)
    data = save(tensors)
    digest = hashlib.sha256(data).hexdigest()
    key = manifest.name[: -len(".json")]
    raw.update(tensors=f"{key}.{digest[:16]}.safetensors", tensors_bytes=len(data), tensors_sha256=digest)
    old.unlink()
    (manifest.parent / raw["tensors"]).write_bytes(data)
    manifest.write_text(json.dumps(raw))


def tree(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` and its bytes' digest (a FIFO or link by its kind)."""
    out = {}
    for path in sorted(directory.rglob("*")):
        name = str(path.relative_to(directory))
        if path.is_symlink():
            out[name] = "link:" + os.readlink(path)
        elif path.is_fifo():
            out[name] = "fifo"
        elif path.is_file():
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


class deadline:
    """Fail (not hang) when the block takes longer than ``seconds``: a blocking open of a FIFO would."""

    def __init__(self, seconds: int) -> None:
        self.seconds = seconds

    def __enter__(self):
        def expired(*_):
            raise TimeoutError(f"blocked for {self.seconds} s")

        self.previous = signal.signal(signal.SIGALRM, expired)
        signal.alarm(self.seconds)

    def __exit__(self, *exc):
        signal.alarm(0)
        signal.signal(signal.SIGALRM, self.previous)


# --- the directory is the server's own ------------------------------------------------------------------


def test_a_model_folder_given_as_the_context_dir_is_refused_and_nothing_in_it_changes(demo_paths):
    model = Path(demo_paths["tiny-llama"])
    before = tree(model)
    for persist in ("off", "on"):
        with pytest.raises(KvxConfigError) as refused:
            build_config("knorm", 0.5, model_path=str(model), context_dir=str(model), persist_contexts=persist)
        assert "holds files this server did not write (chat_template.jinja, config.json" in str(refused.value)
    assert tree(model) == before


def test_an_empty_or_marked_directory_is_accepted_and_marked(tmp_path):
    fresh = tmp_path / "new" / "contexts"
    build_config("knorm", 0.5, context_dir=str(fresh), persist_contexts="on")
    assert [p.name for p in fresh.iterdir()] == [MARKER]
    (fresh / "operator-notes.txt").write_text("mine")  # added later, beside the contexts: the marker stands
    build_config("knorm", 0.5, context_dir=str(fresh), persist_contexts="on")
    (fresh / MARKER).unlink()
    with pytest.raises(KvxConfigError, match="operator-notes.txt"):
        build_config("knorm", 0.5, context_dir=str(fresh))


def test_a_directory_another_starting_server_is_marking_is_accepted(tmp_path):
    # Two servers behind the router start at once on one empty directory: the second lists it while the
    # first's marker is still under its temporary name (CI saw the second refuse the directory).
    shared = tmp_path / "contexts"
    shared.mkdir()
    (shared / f".tmp-4242-123456789-{MARKER}").write_text("{}")
    build_config("knorm", 0.5, context_dir=str(shared), persist_contexts="on")
    assert (shared / MARKER).is_file()
    (shared / MARKER).unlink()
    (shared / ".tmp-4242-123456789-.sglang-kvx-other").write_text("x")  # not our marker's name
    with pytest.raises(KvxConfigError, match="sglang-kvx-other"):
        build_config("knorm", 0.5, context_dir=str(shared))


def plant_operator_files(directory: Path) -> None:
    """What an operator (or another program) may keep beside the contexts, some in our name patterns."""
    (directory / "notes.json").write_text('{"mine": true}')
    (directory / "model.safetensors").write_bytes(b"weights" * 100)
    (directory / ("a" * 40 + ".json")).write_text("not json at all")  # our manifest pattern, not our format
    (directory / ("b" * 40 + ".json")).write_text(json.dumps({"format": 99, "fingerprint": FINGERPRINT}))
    (directory / ("c" * 40 + "." + "d" * 16 + ".safetensors")).write_bytes(b"\x08" + b"\0" * 7 + b'{"x": 1}')
    (directory / ".tmp-1-2-elsewhere.txt").write_text("a temporary name of someone else's")
    os.mkfifo(directory / ("e" * 40 + ".json"))  # our pattern, a FIFO: opening it for reading would block
    os.mkfifo(directory / ("f" * 40 + "." + "0" * 16 + ".safetensors"))
    outside = directory.parent / "outside.json"
    outside.write_text(json.dumps({"format": 1}))
    os.symlink(outside, directory / ("9" * 40 + ".json"))
    for path in directory.iterdir():  # old: past any staleness bound
        if not path.is_symlink() and not path.is_fifo():
            os.utime(path, (0, 0))


def test_an_operators_files_survive_every_scan_flush_and_lru_pass_and_nothing_blocks(tmp_path):
    directory = tmp_path / "contexts"
    directory.mkdir()
    plant_operator_files(directory)
    theirs = tree(directory)
    pool = TensorPool(slots=40)
    with deadline(60):
        admission = server(pool, directory)
        disk = admission.eviction.tiering.disk
        for start in range(900, 1300, 100):
            stored_context(pool, admission, tuple(range(start, start + 12)), fold_layers(KEPT), KEPT)
            evict_all(admission, pool)
            disk.files.capacity = int(2.5 * disk.nbytes / len(disk))  # about two contexts: the LRU pass runs
        assert disk.files.dropped >= 1 and len(disk) >= 1
        disk.rescan()
        assert disk.drain()
        child = Child(list(range(1200, 1212)) + [1])
        assert admit(admission, child).kind == CHILD
        admission.forget_all()  # /flush_cache
    assert {name: digest for name, digest in tree(directory).items() if name in theirs} == theirs
    assert set(tree(directory)) == set(theirs) | {MARKER}
    # The files of our patterns that are not provably ours were counted, not removed.
    assert disk.refused["unreadable_manifest"] >= 2 and disk.refused["not_regular"] >= 2


def test_a_manifest_naming_another_contexts_tensor_file_removes_only_itself(tmp_path):
    a_manifest, a_tensors = write_context(tmp_path, IDS)
    b_manifest, b_tensors = write_context(tmp_path, tuple(range(900, 912)))
    raw = json.loads(a_manifest.read_text())
    b_raw = json.loads(b_manifest.read_text())
    raw.update(tensors=b_raw["tensors"], tensors_bytes=b_raw["tensors_bytes"], tensors_sha256=b_raw["tensors_sha256"])
    a_manifest.write_text(json.dumps(raw))
    pool = TensorPool(slots=40)
    admission = server(pool, tmp_path)
    disk = admission.eviction.tiering.disk
    assert disk.drain()
    assert disk.refused == {"bad_tensor_name": 1} and not a_manifest.exists()
    assert b_manifest.exists() and b_tensors.exists() and a_tensors.exists()  # A's own tensor file: no manifest names it
    child = Child(list(range(900, 912)) + [1])
    assert admit(admission, child).kind == CHILD and child.state.outcome["restored_from"] == "disk"


# --- untrusted bytes ---------------------------------------------------------------------------------------


HOSTILE_MANIFESTS = {
    "ids not a list": lambda raw: raw.update(context_ids={"a": 1}),
    "ids huge": lambda raw: raw.update(context_ids=[10**40] * 12),
    "ids floats": lambda raw: raw.update(context_ids=[1.5] * 12),
    "settings a list": lambda raw: raw.update(settings=[1, 2]),
    "settings extra": lambda raw: raw["settings"].update(extra=1),
    "size a string": lambda raw: raw.update(tensors_bytes="12"),
    "size huge": lambda raw: raw.update(tensors_bytes=10**30),
    "layout slots huge": lambda raw: raw["layout"].update(num_slots=10**18),
    "layout cells garbage": lambda raw: raw["layout"].update(layers=[{"own": "x", "borrowed": 5}] * 3),
    "cells not a list": lambda raw: raw.update(prefix_cells=7),
    "snapshot deep": lambda raw: raw.update(gdn_snapshot=json.loads("{\"list\": [" * 30 + "]}" * 30)),
    "positions garbage": lambda raw: raw.update(keep_positions={"tensor": "nope"}),
    "tensors a path": lambda raw: raw.update(tensors="../../etc/passwd"),
    "tensors not a string": lambda raw: raw.update(tensors=["x"]),
    "tenant a number": lambda raw: raw.update(tenant=7),
    "kept not a list": lambda raw: raw.update(kept_per_layer=None),
}


@pytest.mark.parametrize("what", sorted(HOSTILE_MANIFESTS))
def test_a_hostile_manifest_refuses_that_file_only_and_the_tier_goes_on(tmp_path, what):
    manifest, tensors = write_context(tmp_path, IDS)
    good_manifest, _ = write_context(tmp_path, tuple(range(900, 912)))
    raw = json.loads(manifest.read_text())
    HOSTILE_MANIFESTS[what](raw)
    manifest.write_text(json.dumps(raw))
    pool = TensorPool(slots=40)
    whole = pool.room()
    admission = server(pool, tmp_path)
    disk = admission.eviction.tiering.disk
    assert disk.drain() and disk.io_faults == 0
    child = Child(list(IDS) + [1])
    plan = admit(admission, child)
    assert plan.kind == PLAIN and child.error is None and sum(disk.refused.values()) == 1, disk.refused
    assert pool.room() == whole
    other = Child(list(range(900, 912)) + [1])
    assert admit(admission, other).kind == CHILD  # the tier serves the rest
    assert good_manifest.exists()


def infinite_keys(tensors):
    tensors["k.1"][0, 0, 0] = float("inf")


def nan_values(tensors):
    tensors["v.2"][:] = float("nan")


def other_dtype(tensors):
    tensors["k.0"] = tensors["k.0"].to(torch.float64)


def nan_snapshot(tensors):
    for name in tensors:
        if name.startswith("gdn."):
            tensors[name][:] = float("nan")


def misshapen_snapshot(tensors):
    name = next(n for n in tensors if n.startswith("gdn."))
    tensors[name] = torch.zeros(3, 3)


@pytest.mark.parametrize("change,expected", [(infinite_keys, "non-finite"), (nan_values, "non-finite"),
                                             (other_dtype, "torch.float64"), (nan_snapshot, "non-finite"),
                                             (misshapen_snapshot, "state pool's")])
def test_a_file_with_a_recomputed_checksum_is_still_checked_against_the_pool_before_a_slot_is_taken(
        tmp_path, change, expected):
    state = torch.zeros(2, 1, 4)  # one state slot's snapshot of a hybrid model's pool
    pool = TensorPool(slots=40, state=state)
    admission = server(pool, tmp_path)
    stored_context(pool, admission, IDS, fold_layers(KEPT), KEPT, snapshot=torch.randn(2, 1, 4))
    evict_all(admission, pool)
    manifest = next(tmp_path.glob("*.json"))
    tamper(manifest, change)
    pool2 = TensorPool(slots=40, state=state)
    whole = pool2.room()
    admission2 = server(pool2, tmp_path)
    assert admission2.eviction.tiering.disk.drain()
    child = Child(list(IDS) + [1])
    assert admit(admission2, child).kind == PLAIN and child.error is None
    reason = child.state.outcome["reason"]
    assert "refused (misfit" in reason and expected in reason, reason
    assert str(tmp_path) not in reason and "/" not in reason.split("refused")[1]  # file names, no path
    assert pool2.room() == whole and admission2.eviction.tiering.restore_failures == 1
    assert not manifest.exists()  # ours, and refused: removed
    assert len(admission2.store) == 0


def test_a_tensor_file_replaced_by_a_fifo_is_refused_without_blocking(tmp_path):
    manifest, tensors = write_context(tmp_path, IDS)
    pool = TensorPool(slots=40)
    admission = server(pool, tmp_path)
    assert admission.eviction.tiering.disk.drain()
    tensors.unlink()
    os.mkfifo(tensors)
    child = Child(list(IDS) + [1])
    with deadline(30):
        plan = admit(admission, child)
    assert plan.kind == PLAIN and "not_regular" in child.state.outcome["reason"]


def test_with_a_secret_only_manifests_carrying_its_hmac_are_served(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    directory = tmp_path / "contexts"
    directory.mkdir()
    signed, _ = write_context(directory, IDS, secret_file=str(secret))
    assert "hmac" in json.loads(signed.read_text())
    unsigned, _ = write_context(directory, tuple(range(900, 912)))  # a writer without the secret
    pool = TensorPool(slots=40)
    admission = server(pool, directory, secret_file=str(secret))
    disk = admission.eviction.tiering.disk
    assert disk.drain()
    assert disk.refused == {"bad_signature": 1} and len(disk) == 1
    assert admit(admission, Child(list(IDS) + [1])).kind == CHILD
    assert admit(admission, Child(list(range(900, 912)) + [1])).kind == PLAIN
    # Tampered bytes with a recomputed checksum: the HMAC covers the digest, so it no longer holds.
    tamper(signed, infinite_keys)
    disk.rescan()
    assert disk.drain() and disk.refused["bad_signature"] == 2


# --- the launcher refuses what cannot work -------------------------------------------------------------------


def test_the_launcher_refuses_tiers_that_cannot_work(tmp_path, demo_paths):
    model = demo_paths["tiny-llama"]
    with pytest.raises(KvxConfigError, match="--kvx-persist-contexts: --kvx-context-dir .* cannot be written"):
        build_config("knorm", 0.5, context_dir="/proc/kvx-contexts", persist_contexts="on")
    # tiny-llama: 4 layers x 2 KV heads x 32 dims x K and V x 4 bytes = 2,048 bytes a token.
    with pytest.raises(KvxConfigError, match=r"--kvx-disk-store-gb 1e-12 cannot hold one compacted context: "
                                             r"3072 tokens at --kvx-keep-fraction 0.5 take 0.00315 GB"):
        build_config("knorm", 0.5, model_path=model, context_dir=str(tmp_path / "d"), disk_store_gb="1e-12",
                     context_tokens=3072)
    with pytest.raises(KvxConfigError, match="--kvx-host-store-gb 0.001 cannot hold one compacted context"):
        build_config("knorm", 0.5, model_path=model, host_store_gb="0.001", context_tokens=3072, kv_dtype_bytes=4)
    build_config("knorm", 0.5, model_path=model, host_store_gb="0.01", context_tokens=3072)  # 3.1 MB fits in 10 MB
    with pytest.raises(KvxConfigError, match="--kvx-host-store-gb 1.04858e\\+06 is more than this machine's memory"):
        build_config("knorm", 0.5, host_store_gb="1048576")
    with pytest.raises(KvxConfigError, match="needs --kvx-context-dir"):
        build_config("knorm", 0.5, context_secret_file=str(tmp_path / "s"))
    (tmp_path / "short").write_text("abc")
    with pytest.raises(KvxConfigError, match="holds 3 bytes; a secret needs at least 16"):
        build_config("knorm", 0.5, context_dir=str(tmp_path / "d2"), context_secret_file=str(tmp_path / "short"))


def test_a_read_the_file_system_never_finishes_gives_the_child_up_to_a_full_prefill(tmp_path, monkeypatch):
    """A hung file system (here: the worker's read blocks) never holds a child for good: past the read
    timeout it is served by a full prefill with the reason, and the scheduler thread never waited."""
    import threading
    import time

    import sglang_kvx.store.disk as disk_module
    from sglang_kvx.serve.plans import WAIT_READ

    write_context(tmp_path, IDS)
    pool = TensorPool(slots=40)
    admission = server(pool, tmp_path)
    disk = admission.eviction.tiering.disk
    assert disk.drain()
    release = threading.Event()
    original = disk.files.read
    monkeypatch.setattr(disk.files, "read", lambda entry: release.wait(30) and original(entry))
    monkeypatch.setattr(disk_module, "READ_TIMEOUT_S", 0.3)
    child = Child(list(IDS) + [1])
    admission.before_round(child)
    admission.admit_restore(child, Budget(pool))
    assert child.state.plan.reason == WAIT_READ  # queued while the worker reads
    time.sleep(0.4)
    admission.before_round(child)
    admission.admit_restore(child, Budget(pool))
    assert child.state.plan is None and "was not read in 0.3 s" in child.state.outcome["reason"]
    assert admission.before_round(child).kind == PLAIN and pool.room() == 39
    release.set()
    assert disk.drain()
