"""What admission decides for a request entering a prefill round: one ``Plan``.

Admission (``serve/admission.py``) is a short pipeline of steps, each returning a plan or passing the
request on to the next step; the adapter acts on the plan at the two places SGLang forms a prefill
batch: where a request's prefix is matched (``Req.init_next_round_input``) and where it is charged
to the round's token budget (``PrefillAdder.add_one_req``).

  PLAIN    SGLang serves it as it would without the extension (``reason``: why it is not a child,
           for its ``meta_info["kvx"]``; None when there is nothing to say).
  PARENT   a context to compact when it finishes; it prefills its whole prompt.
  CHILD    it reads ``context``, a compacted context in the pool, as its cached prefix.
  RESTORE  its context is held below the pool (``held``): it comes back into the pool only where the
           round's budget has room for it and for the child (``Admission.admit_restore``), so that
           nothing the extension allocates can make SGLang's own allocation for the batch fail.
  WAIT     it stays queued this round (``reason``: for what); the requests behind it go on.
  REFUSE   it is answered with an error (``reason``, HTTP ``status``) and never runs (``REFUSED``:
           the step that found the fault answered it already).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PLAIN, PARENT, CHILD, RESTORE, WAIT, REFUSE = "plain", "parent", "child", "restore", "wait", "refuse"

# What a waiting child waits for (its plan's reason).
WAIT_PASSES = "second passes"  # its context is still being scored (KVzip's reconstruction pass)
WAIT_ROOM = "room"  # running requests hold the room its restore needs
WAIT_READ = "read"  # its context's file is being read and checked off the scheduler thread
WAIT_REPEAT = "repeated beginning"  # its beginning, which plain requests repeat, is being compacted by the server


@dataclass(frozen=True)
class Plan:
    kind: str
    context: Any = None  # CHILD: the pooled ``CompactedContext`` it reads
    held: Any = None  # RESTORE: ``serve.tiering.Held``, where its context waits below the pool
    reason: str | None = None
    status: int = 400  # REFUSE: the HTTP status (400: the request; 5xx: the server)

    @property
    def queued(self) -> bool:
        """Whether the request stays in SGLang's queue this round (its restore, if any, not yet done)."""
        return self.kind in (WAIT, RESTORE)


def plain(reason: str | None = None) -> Plan:
    return Plan(PLAIN, reason=reason)


def refuse(reason: str, status: int = 400) -> Plan:
    return Plan(REFUSE, reason=reason, status=status)


def wait(reason: str) -> Plan:
    return Plan(WAIT, reason=reason)


PLAIN_PLAN = plain()
PARENT_PLAN = Plan(PARENT)
REFUSED = Plan(REFUSE)
