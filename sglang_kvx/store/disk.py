"""The disk tier: compacted contexts as files, outliving the pool, the host tier and the process.

The file form is ``store/context_file.py``'s; the directory's files are read and written by
``store/context_dir.py``. Every one of those operations runs on this tier's own worker thread, never
on the scheduler's: a write (``--kvx-persist-contexts``, or a context host memory lets go) is queued
and the context stays readable from memory until its files are there; a read (a child's restore) is
queued, and the child waits in SGLang's queue until its context has been read and checked; the
directory is rescanned by the worker (other servers sharing it write and remove files too), and the
scheduler reads the index the worker last published. A slow, hung or hostile file system can then
delay the children of the contexts on it, never the running requests or anyone else's prefill.

Several servers may share the directory (``docs/deployment.md``); use is marked on the manifest's
mtime, which the least-recently-used room-making of every server reads (``--kvx-disk-store-gb``
bounds the bytes of this model's files; every server sharing the path should pass the same bound).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from sglang_kvx.settings import CompactionSettings
from sglang_kvx.store import longest_extended
from sglang_kvx.store.context_dir import ContextDirectory
from sglang_kvx.store.context_file import (DiskEntry, RefusedFile, context_key, model_fingerprint,  # noqa: F401 - re-exported
                                           MARKER)
from sglang_kvx.store.fit_check import PoolFacts
from sglang_kvx.store.tiers import TieredContext

logger = logging.getLogger(__name__)

SCAN_POLL_S = 0.1  # the worker looks at the directory's mtime this often when it has nothing else to do
READ_RESULT_TTL_S = 60.0  # a read nobody collected (its child went away) is dropped after this
READ_TIMEOUT_S = 30.0  # a read not done by then (a hung file system) gives its child up to a full prefill
WORKER_NICENESS = 10  # the worker's scheduling priority below the serving threads' (hashing 64 MiB takes a core for ~40 ms)
_PENDING = object()


class DiskTier:
    """Context files in one directory, this model's at most ``capacity`` bytes; I/O on a worker thread."""

    name = "disk"

    def __init__(self, directory: str | os.PathLike, capacity: int, fingerprint: str, facts: PoolFacts | None = None,
                 secret: bytes | None = None, max_pending_bytes: int | None = None) -> None:
        self.files = ContextDirectory(Path(directory).expanduser(), capacity, fingerprint, facts, secret)
        self.directory = self.files.directory
        self.capacity = capacity
        self.fingerprint = fingerprint
        # Contexts whose writes wait on the worker may hold this much host memory; beyond it a write is dropped.
        self.max_pending_bytes = max_pending_bytes if max_pending_bytes is not None else min(capacity, 1 << 30)
        self.entries: dict[str, DiskEntry] = {}  # the index the worker last published (replaced whole)
        self.writes_dropped = 0  # writes not queued: too large for the tier, or the queue held max_pending_bytes
        self.io_faults = 0  # worker jobs that raised (logged once each kind)
        self._lock = threading.Lock()
        self._writing: dict[str, TieredContext] = {}  # queued or being written: readable from memory meanwhile
        self._reads: dict[str, tuple[float, Any]] = {}  # key -> (since, _PENDING | TieredContext | why not)
        self._jobs: queue.Queue = queue.Queue()
        self._stopped = False
        self._jobs.put(("claim",))
        self._jobs.put(("scan", True))
        self._thread = threading.Thread(target=self._work, name="sglang-kvx-context-dir", daemon=True)
        self._thread.start()

    # --- what the scheduler reads ----------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    @property
    def dropped(self) -> int:
        return self.files.dropped + self.writes_dropped

    @property
    def written(self) -> int:
        return self.files.written

    @property
    def write_failures(self) -> int:
        return self.files.write_failures

    @property
    def refused(self):
        return self.files.refused

    @property
    def last_refusal(self) -> str | None:
        return self.files.last_refusal

    def __len__(self) -> int:
        return len(self.entries)

    def holds(self, context_ids: tuple[int, ...], settings: CompactionSettings) -> bool:
        key = context_key(self.fingerprint, context_ids, settings)
        return key in self.entries or key in self._writing

    def holds_any(self) -> bool:
        return bool(self.entries) or bool(self._writing)

    def longest_prefix_of(self, prompt_ids, settings: CompactionSettings) -> DiskEntry | TieredContext | None:
        with self._lock:
            writing = list(self._writing.values())
        return longest_extended([*self.entries.values(), *writing], prompt_ids, settings)

    def fetch(self, entry: DiskEntry | TieredContext) -> TieredContext | str | None:
        """``entry``'s context, read and checked: the context, why it cannot come back (its file was
        refused, or is gone), or None while the worker reads it (the first call queues the read)."""
        if isinstance(entry, TieredContext):
            return entry  # still being written: the copy in memory is the context
        now = time.monotonic()
        with self._lock:
            writing = self._writing.get(entry.key)
            if writing is not None:
                return writing
            for key, (since, result) in list(self._reads.items()):
                if result is not _PENDING and now - since > READ_RESULT_TTL_S:
                    del self._reads[key]
            found = self._reads.get(entry.key)
            if found is None:
                self._reads[entry.key] = (now, _PENDING)
                self._jobs.put(("read", entry))
                return None
            if found[1] is _PENDING:
                if now - found[0] > READ_TIMEOUT_S:  # never wait on a hung file system for good
                    self._reads[entry.key] = (found[0], "gave up")  # its late result is dropped with it
                    return f"its file was not read in {READ_TIMEOUT_S:g} s"
                return None
            del self._reads[entry.key]
        return found[1]

    def release(self, entry: DiskEntry | TieredContext) -> None:
        """A context read back went into the pool: its files stay (another server, or a restart, reads them)."""

    def put(self, entry: TieredContext) -> list:
        """Queue ``entry``'s write unless its files are there or queued; returns ``[entry]`` when it is not
        held (the queue holds too much already: counted, logged once), else []. The worker removes this
        model's least recently used files for room as it writes."""
        key = context_key(self.fingerprint, entry.context_ids, entry.settings)
        if entry.nbytes > self.capacity:  # its file is larger still: it can never be held
            self.writes_dropped += 1
            return [entry]
        with self._lock:
            if key in self.entries or key in self._writing:
                return []
            pending = sum(e.nbytes for e in self._writing.values())
            if pending + entry.nbytes > self.max_pending_bytes:
                self.writes_dropped += 1
                self.files.warn_once("queue", "sglang_kvx: the context directory's write queue holds %d bytes; "
                                     "a context was not written (logged once)", pending)
                return [entry]
            self._writing[key] = entry
        self._jobs.put(("write", key, entry))
        return []

    def clear(self) -> None:
        """/flush_cache: this model's files go (queued writes first), and whatever was read for children."""
        with self._lock:
            self._reads.clear()
        self._jobs.put(("clear",))
        self.drain()

    def rescan(self) -> None:
        """List the directory again now (another server wrote or removed files), off this thread."""
        self._jobs.put(("scan", True))

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until every job queued so far is done (tests, /flush_cache); whether it was in time."""
        done = threading.Event()
        self._jobs.put(("sync", done))
        return done.wait(timeout)

    def close(self) -> None:
        self._stopped = True
        self._jobs.put(("stop",))

    def queue_report(self) -> dict[str, int]:
        """What /kvx/stats says of the worker's queue."""
        with self._lock:
            reads = sum(1 for _, result in self._reads.values() if result is _PENDING)
            return {"writes_queued": len(self._writing), "write_bytes_queued": sum(e.nbytes for e in self._writing.values()),
                    "reads_queued": reads, "writes_dropped_queue_full": self.writes_dropped, "io_faults": self.io_faults}

    def summaries(self) -> list[dict[str, Any]]:
        return [{"context_tokens": e.n, "bytes": e.nbytes, "policy": e.settings.policy,
                 "keep_fraction": e.settings.keep_fraction, "salted": e.settings.namespace is not None,
                 "tenant": e.tenant} for e in self.entries.values()]

    # --- the worker ------------------------------------------------------------------------------

    def _work(self) -> None:
        try:  # this thread only (Linux: a thread is a task of its own): the scheduler's thread wins a contended core
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICENESS)
        except (AttributeError, OSError):  # another platform, or not permitted: the same priority as serving
            pass
        while True:
            try:
                job = self._jobs.get(timeout=SCAN_POLL_S)
            except queue.Empty:
                job = ("scan", False)
            if job[0] == "stop":
                return
            try:
                self._run(job)
            except Exception as exc:  # noqa: BLE001 - the worker outlives any one job's fault
                self.io_faults += 1
                self.files.warn_once(f"fault:{job[0]}:{type(exc).__name__}", "sglang_kvx: the context directory's %s "
                                     "job failed (%s: %s); serving goes on", job[0], type(exc).__name__, exc)
            finally:
                if job[0] == "write":
                    with self._lock:
                        self._writing.pop(job[1], None)
                elif job[0] == "read":
                    with self._lock:
                        if self._reads.get(job[1].key, (0, None))[1] is _PENDING:
                            self._reads[job[1].key] = (time.monotonic(), "the context's file could not be read")
                elif job[0] == "sync":
                    job[1].set()
                self.entries = dict(self.files.entries)  # published whole: the scheduler never sees a half-updated index

    def _run(self, job: tuple) -> None:
        kind = job[0]
        if kind == "claim":
            self.files.claim()
        elif kind == "scan":
            self.files.scan(force=job[1])
        elif kind == "write":
            for gone in self.files.write(job[2]):
                logger.info("sglang_kvx: disk tier let a %d-token context go (%d bytes)", gone.n, gone.nbytes)
        elif kind == "read":
            self._read(job[1])
        elif kind == "clear":
            self.files.clear()

    def _read(self, entry: DiskEntry) -> None:
        try:
            result: Any = self.files.read(entry)
        except RefusedFile as refused:
            result = f"its file was refused ({refused})"
        except OSError as exc:
            result = f"its file could not be read ({exc.strerror or type(exc).__name__})"
        with self._lock:
            if entry.key in self._reads:
                self._reads[entry.key] = (time.monotonic(), result)
