"""The disk tier (issue #44 item 2) on the plain pool views the compactor's tests use, with real files:
an evicted (or, with persistence, every stored) context is written as safetensors plus a JSON
manifest and comes back byte for byte -- in this server, in a new one on the same directory (a
restart), whatever its layout; host memory's let-go contexts go down to it; a torn, truncated,
corrupted or foreign file is never served (refused, counted, removed -- another model's left
alone); an unwritable directory leaves serving as it was; concurrent and killed writers leave
only files that load; the tier keeps to its bytes, least recently used out first."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sglang_kvx.compact.layout import fold_heads, fold_layers
from sglang_kvx.serve.admission import Admission
from sglang_kvx.settings import ServerDefaults
from sglang_kvx.store import ContextStore
from sglang_kvx.serve.plans import CHILD, PLAIN
from sglang_kvx.store.context_dir import ContextDirectory
from sglang_kvx.store.context_file import MARKER
from sglang_kvx.store.disk import DiskTier, context_key, model_fingerprint
from sglang_kvx.store.tiers import TieredContext
from test_compactor_views import TensorPool
from test_context_tiers import SETTINGS, Child, _cells, admit, scribble, stored_context

FINGERPRINT = "f" * 32


def server(pool: TensorPool, directory: Path, host_gb: float = 0.0, disk_gb: float = 1.0, persist: bool = False,
           fingerprint: str = FINGERPRINT) -> Admission:
    return Admission(pool, ContextStore(), ServerDefaults(
        "knorm", 0.5, 0, frozenset({"keys"}), min_store_fraction=0.0, host_store_gb=host_gb, context_dir=str(directory),
        disk_store_gb=disk_gb, persist_contexts=persist, model_fingerprint=fingerprint), num_rows=4)


def snapshot_of_a_hybrid() -> tuple:
    """Shaped like SGLang's MambaPool copy: (per-layer conv states, temporal states), other dtypes."""
    return ([torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 2).to(torch.bfloat16)], torch.randn(2, 1, 2, 4, 4))


def same_tree(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    return a == b


def evict_all(admission: Admission, pool: TensorPool) -> None:
    """Every stored context out of the pool, down the tiers; the disk tier's writes done."""
    assert admission.eviction.make_room(pool.room() + 2) is None and len(admission.store) == 0
    disk = admission.eviction.tiering.disk
    if disk is not None:
        assert disk.drain()


def read_back(tier: DiskTier, entry) -> TieredContext | str:
    """``entry`` read by the tier's worker (the first fetch queues the read)."""
    for _ in range(100):
        found = tier.fetch(entry)
        if found is not None:
            return found
        tier.drain()
    raise AssertionError("the read never finished")


def fresh_tier(directory, **kwargs) -> DiskTier:
    """A tier on ``directory`` whose first scan is done."""
    tier = DiskTier(directory, **kwargs)
    assert tier.drain()
    return tier


def restore_and_check(admission: Admission, pool: TensorPool, ids, images, layout, kept, snapshot, positions,
                      tier: str = "disk") -> None:
    scribble(pool)
    pool.alloc(3)  # the freed slots are not where they were
    child = Child(list(ids) + [7, 8, 9])
    assert admit(admission, child).kind == CHILD and child.error is None, child.state.outcome
    restored = child.state.context
    assert child.state.outcome["restored_from"] == tier, child.state.outcome
    assert restored.kept_per_layer == kept and restored.layout == layout and restored.settings == SETTINGS
    assert same_tree(restored.gdn_snapshot, snapshot) and same_tree(restored.keep_positions, positions)
    for layer in range(pool.num_layers):
        keys, values = pool.read(layer, restored.slots)
        assert torch.equal(keys, images[layer][0]) and torch.equal(values, images[layer][1])
    from sglang_kvx.compact.compactor import Compactor

    fresh = Compactor(pool, lambda name: None, 2, [10, 11, 12], [], True).prefix_cells(restored.slots, layout)
    if not layout.per_head:
        assert _cells(restored.prefix_cells) == _cells(fresh)
    counts = admission.eviction.tiering.counts()
    assert counts[f"{tier}_restores"] == 1 and counts[f"{tier}_restore_seconds"] > 0


@pytest.mark.parametrize("kind", ["folded", "per-head"])
def test_an_evicted_context_is_written_and_read_back_byte_for_byte_in_a_new_server(tmp_path, kind):
    if kind == "folded":
        kept = [2, 8, 5]
        layout = fold_layers(kept)
        positions = [torch.arange(k).repeat(2, 1) for k in kept]
    else:
        per_head = [[2, 6], [4, 4], [5, 3]]
        layout, kept = fold_heads(per_head), [max(h) for h in per_head]
        positions = [[torch.arange(k) for k in heads] for heads in per_head]
    snapshot = snapshot_of_a_hybrid()
    pool = TensorPool(slots=40, state=tuple(t if isinstance(t, torch.Tensor) else [torch.zeros_like(x) for x in t]
                                            for t in snapshot))
    admission = server(pool, tmp_path)
    ids = tuple(range(100, 112))
    context = stored_context(pool, admission, ids, layout, kept, tenant="t1", snapshot=snapshot)
    context.keep_positions = positions
    images = [tuple(t.clone() for t in pool.read(layer, context.slots)) for layer in range(pool.num_layers)]
    evict_all(admission, pool)
    disk = admission.eviction.tiering.disk
    assert len(disk) == 1 and admission.eviction.tiering.counts()["disk_contexts_stored"] == 1
    names = sorted((n for n in os.listdir(tmp_path) if n != MARKER), key=lambda name: name.endswith(".safetensors"))
    assert len(names) == 2 and names[0].endswith(".json") and names[1].endswith(".safetensors"), names
    manifest = json.loads((tmp_path / names[0]).read_text())
    assert manifest["context_ids"] == list(ids) and manifest["fingerprint"] == FINGERPRINT and manifest["tenant"] == "t1"
    assert (tmp_path / names[1]).stat().st_size == manifest["tensors_bytes"] == disk.nbytes
    names = sorted(names)
    # A new server on the directory (a restart): nothing in its pool, the file found and restored.
    pool2 = TensorPool(slots=40, state=pool.state)
    admission2 = server(pool2, tmp_path)
    admission2.eviction.tiering.disk.drain()
    restore_and_check(admission2, pool2, ids, images, layout, kept, snapshot, positions)
    assert admission2.store.get(ids, SETTINGS).tenant == "t1"
    assert sorted(os.listdir(tmp_path)) == sorted(names + [MARKER])  # the files stay: another server, or a restart, may read them
    # ... and the first server restores it too (it evicted it).
    restore_and_check(admission, pool, ids, images, layout, kept, snapshot, positions)
    admission.forget_all()
    assert len(admission.store) == 0
    assert admission.eviction.tiering.counts()["disk_contexts"] == 0 and os.listdir(tmp_path) == [MARKER]  # /flush_cache


def test_host_memory_lets_go_down_to_disk_and_persisted_contexts_outlive_the_server(tmp_path):
    pool = TensorPool(slots=60)
    kept = [4, 4, 4]
    one = 2 * 3 * 4 * pool.bytes_per_entry // 2  # one context's keys and values, bytes
    admission = server(pool, tmp_path, host_gb=1.5 * one / 1e9)  # host memory holds one context
    first, second = tuple(range(500, 512)), tuple(range(600, 612))
    images = {}
    for ids in (first, second):
        context = stored_context(pool, admission, ids, fold_layers(kept), kept)
        images[ids] = [tuple(t.clone() for t in pool.read(layer, context.slots)) for layer in range(pool.num_layers)]
        evict_all(admission, pool)
    tiering = admission.eviction.tiering
    assert len(tiering.host) == 1 and len(tiering.disk) == 1  # the older went down a tier
    assert tiering.disk.holds(first, SETTINGS) and not tiering.disk.holds(second, SETTINGS)
    counts = tiering.counts()
    assert counts["host_contexts_stored"] == 2 and counts["disk_contexts_stored"] == 1 and counts["host_contexts_dropped"] == 1
    restore_and_check(admission, pool, first, images[first], fold_layers(kept), kept, None, [])
    admission.forget_all()

    # Persistence: written when stored, before any eviction; a new server restores it.
    directory = tmp_path / "persisted"
    pool = TensorPool(slots=40)
    admission = server(pool, directory, persist=True)
    ids = tuple(range(700, 712))
    context = stored_context(pool, admission, ids, fold_layers(kept), kept)
    images = [tuple(t.clone() for t in pool.read(layer, context.slots)) for layer in range(pool.num_layers)]
    assert admission.eviction.tiering.disk.drain()
    assert admission.eviction.tiering.counts()["disk_files_written"] == 1 and len(os.listdir(directory)) == 3
    evict_all(admission, pool)  # already on disk: not written twice
    assert admission.eviction.tiering.counts()["disk_files_written"] == 1
    pool2 = TensorPool(slots=40)
    admission2 = server(pool2, directory, persist=True)
    admission2.eviction.tiering.disk.drain()
    restore_and_check(admission2, pool2, ids, images, fold_layers(kept), kept, None, [])


def one_file(tmp_path: Path) -> tuple[Admission, TensorPool, tuple, Path, Path]:
    pool = TensorPool(slots=40)
    admission = server(pool, tmp_path)
    ids = tuple(range(800, 812))
    stored_context(pool, admission, ids, fold_layers([4, 4, 4]), [4, 4, 4])
    evict_all(admission, pool)
    manifest = next(tmp_path.glob("*.json"))
    tensors = next(tmp_path.glob("*.safetensors"))
    return admission, pool, ids, manifest, tensors


def damage_truncated(manifest: Path, tensors: Path) -> None:
    tensors.write_bytes(tensors.read_bytes()[:-17])


def damage_flipped(manifest: Path, tensors: Path) -> None:
    data = bytearray(tensors.read_bytes())
    data[-5] ^= 0x40
    tensors.write_bytes(bytes(data))


def damage_torn_manifest(manifest: Path, tensors: Path) -> None:
    manifest.write_text(manifest.read_text()[:50])


def damage_other_ids(manifest: Path, tensors: Path) -> None:
    raw = json.loads(manifest.read_text())
    raw["context_ids"][3] += 1  # not the context its name says
    manifest.write_text(json.dumps(raw))


@pytest.mark.parametrize("damage,reason,read_at_restore,removed", [
    (damage_truncated, "size", True, True), (damage_flipped, "checksum", True, True),
    (damage_torn_manifest, "unreadable_manifest", False, False), (damage_other_ids, "key_mismatch", False, True)])
def test_a_damaged_file_is_refused_and_the_child_served_by_a_full_prefill(tmp_path, damage, reason, read_at_restore,
                                                                          removed):
    """A file of ours that fails its checks is refused and removed; one that does not even parse as a
    manifest of ours (torn) is refused and left alone -- it cannot be proven ours."""
    _, _, ids, manifest, tensors = one_file(tmp_path)
    damage(manifest, tensors)
    pool = TensorPool(slots=40)
    whole = pool.room()
    admission = server(pool, tmp_path)  # a restart finds the damaged file
    disk = admission.eviction.tiering.disk
    disk.drain()
    child = Child(list(ids) + [1])
    assert admit(admission, child).kind == PLAIN and child.error is None and child.state.context is None
    assert disk.refused == {reason: 1}, disk.refused
    if read_at_restore:  # found by its manifest, refused when its bytes were read
        assert "its file was refused" in child.state.outcome["reason"] and reason in child.state.outcome["reason"]
        assert admission.eviction.tiering.restore_failures == 1
        assert str(tmp_path) not in child.state.outcome["reason"]  # no machine path in a response
    assert manifest.exists() is not removed and len(disk) == 0 and pool.room() == whole
    counts = admission.eviction.tiering.counts()
    assert counts["disk_files_refused"] == 1 and counts["disk_restores"] == 0
    disk.rescan()
    disk.drain()
    assert disk.refused == {reason: 1}  # counted once


def test_another_models_file_never_loads_and_is_left_for_its_own_servers(tmp_path):
    _, _, ids, manifest, tensors = one_file(tmp_path)
    pool = TensorPool(slots=40)
    admission = server(pool, tmp_path, fingerprint="0" * 32)
    admission.eviction.tiering.disk.drain()
    child = Child(list(ids) + [1])
    assert admit(admission, child).kind == PLAIN and child.state.context is None
    disk = admission.eviction.tiering.disk
    assert disk.refused == {"other_model": 1} and len(disk) == 0 and disk.nbytes == 0
    assert manifest.exists() and tensors.exists()
    admission.forget_all()  # this model's flush leaves the other model's files
    assert manifest.exists() and tensors.exists()


def test_an_unwritable_directory_logs_once_and_serving_goes_on(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    pool = TensorPool(slots=40)
    whole = pool.room()
    admission = server(pool, blocker / "contexts")  # cannot be created
    for start in (900, 1000):
        stored_context(pool, admission, tuple(range(start, start + 12)), fold_layers([4] * 3), [4] * 3)
        evict_all(admission, pool)
    counts = admission.eviction.tiering.counts()
    # Sent down (queued for the tier's worker), never written.
    assert counts["disk_write_failures"] == 2 and counts["disk_contexts"] == 0 and counts["disk_files_written"] == 0
    assert sum("cannot write context files" in r.message for r in caplog.records) == 1
    child = Child(list(range(900, 912)) + [1])
    assert admit(admission, child).kind == PLAIN and child.error is None  # a plain request, as without the tier
    assert pool.room() == whole


TOY_TOKENS = 1 << 17  # every toy context's length: more tokens than the largest toy keeps entries


def toy(i: int, size: int = 64) -> TieredContext:
    keys = torch.full((size // 16, 1, 2), float(i))  # [S, heads, D] float32: size bytes of keys and values
    return TieredContext(context_ids=(i,) * TOY_TOKENS, settings=SETTINGS, kept_per_layer=[keys.shape[0]],
                         layout=fold_layers([keys.shape[0]]), keys=[keys], values=[keys.clone()], prefix_cells=[None])


def test_the_disk_tier_keeps_to_its_bytes_least_recently_used_out_first(tmp_path):
    file_bytes = len(__import__("safetensors.torch", fromlist=["save"]).save({"k.0": toy(0).keys[0], "v.0": toy(0).values[0],}))
    tier = fresh_tier(tmp_path, capacity=3 * file_bytes + 10, fingerprint=FINGERPRINT)
    for i in range(3):
        assert tier.put(toy(i)) == []
        tier.drain()
        os.utime(tmp_path / f"{context_key(FINGERPRINT, (i,) * TOY_TOKENS, SETTINGS)}.json", (i, i))
    tier.rescan()
    tier.drain()
    read_back(tier, tier.longest_prefix_of((0,) * (TOY_TOKENS + 1), SETTINGS))  # used: no longer the least recently used
    assert tier.put(toy(3)) == [] and tier.drain()
    assert sorted(e.context_ids[0] for e in tier.entries.values()) == [0, 2, 3] and tier.dropped == 1
    assert tier.put(toy(3)) == [] and tier.drain() and tier.written == 4  # held already: not written again
    too_big = toy(9, size=64 * 16)
    assert tier.put(too_big) == [too_big] and tier.drain() and len(tier) == 3  # can never fit: dropped
    assert tier.dropped == 2
    assert len(list(tmp_path.glob("*.json"))) == 3 == len(list(tmp_path.glob("*.safetensors")))


def _write_loop(directory: str, seed: int, rounds: int) -> None:
    files = ContextDirectory(Path(directory), 10**9, FINGERPRINT, None, None)  # what the tier's worker runs
    torch.manual_seed(seed)
    for _ in range(rounds):
        entry = toy(1, size=4096)
        entry.keys[0].add_(torch.rand(1))  # each writer's own bytes for the same key
        files.entries.clear()  # write it again whatever the index says
        files.write(entry)


def test_two_servers_writing_the_same_context_at_once_leave_one_valid_file(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_write_loop, args=(str(tmp_path), seed, 30)) for seed in (1, 2)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(120)
        assert w.exitcode == 0
    assert len(list(tmp_path.glob("*.json"))) == 1 and not list(tmp_path.glob(".tmp-*"))
    tier = fresh_tier(tmp_path, capacity=10**9, fingerprint=FINGERPRINT)
    found = tier.longest_prefix_of((1,) * (TOY_TOKENS + 1), SETTINGS)
    assert found is not None and read_back(tier, found).keys[0].shape == (256, 1, 2) and not tier.refused


KILLED_WRITER = """
import sys, torch
sys.path.insert(0, {tests!r})
from pathlib import Path
from test_disk_tier import toy, FINGERPRINT
from sglang_kvx.store.context_dir import ContextDirectory
files = ContextDirectory(Path({directory!r}), 10**12, FINGERPRINT, None, None)  # what the tier's worker runs
print("ready", flush=True)
i = 0
while True:
    i += 1
    files.write(toy(i, size=1 << 21))
"""


def test_kill_9_during_writes_leaves_no_file_that_loads_wrong(tmp_path):
    """A writer killed at random moments: every manifest left names a whole, correct tensor file;
    what the dead writer left half-written is never loaded and goes once stale."""
    tests = str(Path(__file__).parent)
    for delay in (0.3, 0.55, 0.8):
        proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER.format(tests=tests, directory=str(tmp_path))],
                                stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    tier = fresh_tier(tmp_path, capacity=10**12, fingerprint=FINGERPRINT)
    assert len(tier) >= 2 and not tier.refused
    for entry in list(tier.entries.values()):
        i = entry.context_ids[0]
        assert torch.equal(read_back(tier, entry).keys[0], toy(i, size=1 << 21).keys[0])
    assert not tier.refused
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")
                 or (p.suffix == ".safetensors" and p.name not in {e.manifest["tensors"] for e in tier.entries.values()})]
    for path in leftovers:  # a dead writer's, aged past the staleness bound
        os.utime(path, (0, 0))
    tier.rescan()
    tier.drain()
    assert all(not p.exists() for p in leftovers) and len(tier) >= 2


def test_the_fingerprint_changes_with_the_model_the_tokenizer_and_the_kv_layout(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    (model / "model.safetensors").write_bytes(b"x" * 10)
    facts = {"kv_dtype": "torch.bfloat16", "kv_heads": 2}
    base = model_fingerprint(str(model), "", facts)
    assert base == model_fingerprint(str(model), "", dict(facts))
    assert base != model_fingerprint(str(model), "", {**facts, "kv_dtype": "torch.float16"})
    (model / "model.safetensors").write_bytes(b"x" * 11)
    other_weights = model_fingerprint(str(model), "", facts)
    (model / "tokenizer.json").write_text("{}")
    assert len({base, other_weights, model_fingerprint(str(model), "", facts)}) == 3
    assert model_fingerprint("org/hub-model", "", facts) != model_fingerprint("org/other", "", facts)
