"""``kvzap`` / ``kvzap_linear`` at decode time: each token scored once by KVzap's surrogate when it is
written, kept or dropped for good when it leaves the window, and its slot given back once every
attention layer and KV head dropped it.

Jegou & Jeblick 2026 (KVzap, Algorithm 1: "decoding is similar but needs a score buffer to enforce
the sliding window"; kvpress's ``DMSPress(decoding=True)``). Every token of the request -- the
prompt's, scored chunk by chunk in its prefill, and each generated one in its decode step -- gets its
predicted log KVzip+ score per (attention layer, KV head) from its own attention-input hidden state
(``policies/kvzap.py``'s surrogate, trained for the served checkpoint). At a decode step with S keys
the last ``window`` tokens before the current one are always read; every older entry has been decided
once, for good: kept if its score >= ``threshold``, else dropped for that layer and head (a decision
made from scores that never change, so taking it when the token leaves the window or at any later
step is the same). Compression happens after attention, as in kvpress: the step whose window a token
leaves still reads it.

Memory: a slot holds every layer's and KV head's entry of its token, and heads decide on their own
(on SmolLM2-135M, 90 (layer, head) cells a token), so a token whose every entry is dropped is rare.
Every ``FOLD_EVERY`` newly decided positions the row's decided stretch is re-folded instead
(``HeadFold``: ``compact/layout.fold_heads``, as a compacted context): each (layer, KV head)'s kept
entries are copied into ceil(kept / (L * H)) fresh slots, any (layer, head) lending its empty cells to
another, and every own slot of the stretch goes back to SGLang's pool (``freed_positions`` tells the
runner which). The stretch starts where the request's own slots do: prompt entries the prefix cache
holds are shared with other requests, so they are only masked. Entries a prefix-cache hit gave the
prompt were never scored by this request: they are kept (``unscored`` in the report).

Per-head drops are read as cells (``RowState.head_cells``: each KV head its kept entries, in the fold's
slots or the row's, the current token from the row), through the per-head path SGLang's backends run for
KVzip's compacted contexts; such rows run eagerly. On a child of a compacted context the step is
refused (it drops entries; the per-head cells of both are not combined yet).

Against kvpress: it masks dropped keys for later queries (memory is not freed) where here they leave
attention and, when no head keeps them, the pool; the rule, the window and the threshold are the same.
The ``threshold`` defaults to the surrogate manifest's (per request: ``{"step": "kvzap", "threshold": -5}``).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch

from sglang_kvx.compact.layout import fold_heads
from sglang_kvx.decode.base import DecodeStep, StepUnavailable, register_decode_step
from sglang_kvx.decode.row_state import RowState
from sglang_kvx.policies.kvzap import WINDOW, KVzapSurrogate, SurrogateMismatch, find_surrogate


FOLD_EVERY = 64  # newly decided positions between two re-folds of a running row

Cells = list  # per KV head: [(attention layer of the buffer, its KV head, pool slots), ...] in rank order


class HeadFold:
    """A row's decided positions [start, end): each (layer, KV head)'s kept entries packed into the
    fold's own ``slots`` (a ``fold_heads`` layout). ``cells[l][h]`` are where they sit, ``positions[l][h]``
    the positions they hold (ascending, rank order)."""

    def __init__(self, start: int, end: int, slots: torch.Tensor, cells: list[Cells],
                 positions: list[list[torch.Tensor]]) -> None:
        self.start, self.end, self.slots, self.cells, self.positions = start, end, slots, cells, positions

    @classmethod
    def build(cls, pool: Any, row_slots: torch.Tensor, old: "HeadFold | None", start: int, end: int,
              keep: list[torch.Tensor]) -> "HeadFold | None":
        """The fold of [start, end) from ``keep[l]`` [H, end] (True: kept); entries before ``old.end``
        are copied from the old fold's cells, later ones from the row. None: no room in the pool."""
        positions = [[k[start:end].nonzero(as_tuple=True)[0] + start for k in layer] for layer in keep]
        layout = fold_heads([[int(p.numel()) for p in layer] for layer in positions])
        slots = pool.alloc(layout.num_slots) if layout.num_slots else row_slots[:0]
        if slots is None:
            return None
        sources = [[cls._sources(old, row_slots, layer, head, p) for head, p in enumerate(heads)]
                   for layer, heads in enumerate(positions)]
        images = []
        for layer in range(len(keep)):
            k, v = pool.read(layer, slots[:0])
            images.append((k.new_zeros((layout.num_slots, *k.shape[1:])), v.new_zeros((layout.num_slots, *v.shape[1:]))))
        cells: list[Cells] = []
        for layer, heads in enumerate(sources):
            cells.append([])
            for head, pieces in enumerate(heads):
                keys, values = zip(*[(k[:, h], v[:, h]) for buf, h, at in pieces for k, v in [pool.read(buf, at)]]) \
                    if pieces else ((), ())
                keys = torch.cat(keys) if keys else None
                values = torch.cat(values) if values else None
                placed, rank = [], 0
                target = layout.heads[layer][head]
                for holder, holder_head, a, b in [(layer, head, 0, target.own)] + [
                        (c.layer, c.head, c.start, c.end) for c in target.borrowed]:
                    if b > a:
                        images[holder][0][a:b, holder_head] = keys[rank : rank + b - a]
                        images[holder][1][a:b, holder_head] = values[rank : rank + b - a]
                        placed.append((holder, holder_head, slots[a:b]))
                        rank += b - a
                cells[layer].append(placed)
        for layer, (k, v) in enumerate(images):
            if layout.num_slots:
                pool.write(layer, slots, k, v)
        return cls(start, end, slots, cells, positions)

    @staticmethod
    def _sources(old: "HeadFold | None", row_slots: torch.Tensor, layer: int, head: int,
                 positions: torch.Tensor) -> Cells:
        """Where the entries of ``positions`` of (layer, head) are now: the old fold's cells, then the row."""
        pieces: Cells = []
        if old is not None and positions.numel() and int(positions[0]) < old.end:
            inside = positions[positions < old.end]
            ranks = torch.searchsorted(old.positions[layer][head], inside)
            offset = 0
            for buf, h, at in old.cells[layer][head]:
                take = ranks[(ranks >= offset) & (ranks < offset + at.numel())] - offset
                if take.numel():
                    pieces.append((buf, h, at[take.to(at.device)]))
                offset += at.numel()
            positions = positions[positions >= old.end]
        if positions.numel():
            pieces.append((layer, head, row_slots[positions.to(row_slots.device)]))
        return pieces


@functools.lru_cache(maxsize=8)
def surrogate_for(model_path: str, kind: str, folder: str = "") -> KVzapSurrogate:
    """The checkpoint's ``kind`` surrogate (in ``folder`` when given: ``--kvx-kvzap-surrogates``), loaded
    once per process; refused (``SurrogateMismatch``) when none was trained for it."""
    return KVzapSurrogate.load(find_surrogate(model_path, kind, folder or None), model_path=model_path)


class KVzapRow(RowState):
    """Per attention layer the row's scores [H, capacity] (NaN: not scored), its fold, and the positions
    whose own slots it gave back."""

    report = "kvzap_requests"

    def __init__(self, step, request, facts) -> None:
        super().__init__(step, request, facts)
        self.surrogate: KVzapSurrogate = facts.resources[step.name]  # its load_resources
        threshold = step.threshold if step.threshold is not None else self.surrogate.manifest.get("threshold")
        if threshold is None:
            raise ValueError(f"decode step {step.name!r}: no threshold given and the surrogate's manifest has none")
        self.threshold = float(threshold)
        self.scores: list[torch.Tensor | None] = [None] * facts.pool.num_layers
        self.fold: HeadFold | None = None
        self.given_back = torch.zeros(0, dtype=torch.bool)  # own positions whose slots went back
        self.kv_len = 0

    @staticmethod
    def totals(num_layers: int) -> dict:
        return {"kvzap_finished": 0,  # finished requests under KVzap's decode step
                "kvzap_dropped_entries": 0,  # ... entries they dropped, over layers and KV heads
                "kvzap_slots_freed": 0}  # ... own slots they gave back while running, less their folds' slots

    @property
    def masks(self) -> bool:
        return True  # its rows read per-head cells and are scored from the tap: never a captured graph

    def attention_input(self, layer: int, positions: range, hidden: torch.Tensor) -> None:
        scores = self.surrogate.score(layer, hidden).cpu()  # [H, t]
        held = self.scores[layer]
        if held is None or held.shape[1] < positions.stop:
            width = max(positions.stop, 2 * (0 if held is None else held.shape[1]), 64)
            grown = torch.full((scores.shape[0], width), float("nan"))
            if held is not None:
                grown[:, : held.shape[1]] = held
            self.scores[layer] = held = grown
        held[:, positions.start : positions.stop] = scores

    def dropped(self, layer: int, decided: int) -> torch.Tensor:
        """[H, decided] bool: the entries of positions < ``decided`` this layer's heads dropped (NaN: unscored, kept)."""
        held = self.scores[layer]
        out = torch.zeros((self.surrogate.num_kv_heads, decided), dtype=torch.bool)
        if held is not None and decided:
            width = min(decided, held.shape[1])
            out[:, :width] = held[:, :width] < self.threshold
        return out

    def head_cells(self, row: int, layer: int, seq_len: int) -> list[Cells] | None:
        """Each KV head reads its kept entries (the fold's cells, then the row's) and the window."""
        decided = max(0, seq_len - 1 - self.step.window)
        dropped = self.dropped(layer, decided)
        if self.fold is None and not bool(dropped.any()):
            return None  # nothing dropped in this layer yet: the plain row
        keep = torch.ones((dropped.shape[0], seq_len - 1), dtype=torch.bool)
        keep[:, :decided] = ~dropped
        fold = self.fold
        if fold is not None:
            keep[:, fold.start : fold.end] = False  # read from the fold's cells instead
        slots = self.facts.pool.row(row, seq_len)
        out = []
        for head in range(keep.shape[0]):
            pieces = list(fold.cells[layer][head]) if fold is not None else []
            at = keep[head].nonzero(as_tuple=True)[0]
            out.append(pieces + ([(layer, head, slots[at.to(slots.device)])] if at.numel() else []))
        return out

    def after_step(self, row: int, seq_len: int) -> None:
        """The step with ``seq_len`` keys ran: every position < seq_len - window is decided. The row's own
        slots whose entries no layer and head kept go back to the pool; every FOLD_EVERY newly decided
        positions, the decided stretch is re-folded and all its own slots go back."""
        self.kv_len = seq_len
        decided = max(0, seq_len - self.step.window)
        if self.given_back.numel() < decided:
            self.given_back = torch.cat([self.given_back, torch.zeros(decided - self.given_back.numel(), dtype=torch.bool)])
        start = self.request.owned_from  # the prefix cache's slots before it are shared: only masked
        if self.fold is not None and start != self.fold.start:
            raise NotImplementedError("kvzap: the prefix cache took positions of the row's fold")
        dropped = [self.dropped(layer, decided) for layer in range(len(self.scores))]
        slots = self.facts.pool.row(row, seq_len)
        gone = torch.stack([d.all(dim=0) for d in dropped]).all(dim=0) if dropped else torch.zeros(decided, dtype=torch.bool)
        gone[:start] = False
        self._give_back(slots, gone & ~self.given_back[:decided])
        if decided - (self.fold.end if self.fold is not None else start) >= FOLD_EVERY:
            fold = HeadFold.build(self.facts.pool, slots, self.fold, start, decided, [~d for d in dropped])
            if fold is not None:  # no room: the row keeps its slots until the next try
                if self.fold is not None:
                    self.facts.pool.free(self.fold.slots)
                self.fold = fold
                stretch = torch.zeros(decided, dtype=torch.bool)
                stretch[start:] = True
                self._give_back(slots, stretch & ~self.given_back[:decided])

    def _give_back(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        if bool(positions.any()):
            self.facts.pool.free(slots[positions.nonzero(as_tuple=True)[0].to(slots.device)])
            self.given_back[: positions.numel()] |= positions

    def freed_positions(self, owned_len: int) -> torch.Tensor | None:
        if not bool(self.given_back.any()):
            return None
        out = torch.zeros(owned_len, dtype=torch.bool)
        width = min(owned_len, self.given_back.numel())
        out[:width] = self.given_back[:width]
        return out

    def _counts(self) -> tuple[int, int, int]:
        """(entries dropped, entries decided, unscored positions) over layers and KV heads."""
        decided = max(0, self.kv_len - self.step.window)
        dropped = sum(int(self.dropped(layer, decided).sum()) for layer in range(len(self.scores)))
        held = self.scores[0]
        unscored = int(held[0, : self.kv_len].isnan().sum()) if held is not None else self.kv_len
        return dropped, decided * self.surrogate.num_kv_heads * len(self.scores), unscored

    def summary(self, row: int) -> dict:
        dropped, decided, unscored = self._counts()
        entries = self.kv_len * self.surrogate.num_kv_heads * len(self.scores)
        fold_slots = int(self.fold.slots.numel()) if self.fold is not None else 0
        return {"decode": self.step.name, "threshold": self.threshold, "window": self.step.window,
                "kept_fraction": round(1 - dropped / entries, 6) if entries else 1.0, "dropped_entries": dropped,
                "decided_entries": decided, "own_slots_given_back": int(self.given_back.sum()), "fold_slots": fold_slots,
                "folded": [self.fold.start, self.fold.end] if self.fold is not None else None,
                "slots_freed": int(self.given_back.sum()) - fold_slots, "unscored": unscored}

    def release(self, row: int) -> None:
        summary = self.summary(row)
        self.facts.totals["kvzap_finished"] += 1
        self.facts.totals["kvzap_dropped_entries"] += summary["dropped_entries"]
        self.facts.totals["kvzap_slots_freed"] += summary["slots_freed"]
        if self.fold is not None:
            self.facts.pool.free(self.fold.slots)
            self.fold = None


@register_decode_step("kvzap")
class KVzapDecode(DecodeStep):
    options = ("window",)
    real_options = ("threshold",)
    drops = True
    reads_attention_inputs = True
    needs: ClassVar[frozenset[str]] = frozenset({"hidden_states"})
    model_hint = "a dense attention model with a KVzap surrogate (weights/kvzap/)"
    row_state = KVzapRow
    kind: ClassVar[str] = "mlp"
    tp_unsafe = "a rank's row would have to score and fold only its own KV heads, which is not built yet"

    @classmethod
    def load_resources(cls, config: Any, device: torch.device | None = None) -> KVzapSurrogate:
        """The surrogate trained for the served checkpoint (``--kvx-kvzap-surrogates``, else found by its
        fingerprint); none trained for it: the step's requests are refused with the command that trains one."""
        try:
            return surrogate_for(str(config.model_path or ""), cls.kind, getattr(config, "kvzap_surrogates", "") or "")
        except (SurrogateMismatch, OSError) as exc:
            raise StepUnavailable(str(exc)) from None

    @classmethod
    def totals(cls, num_layers: int) -> dict:
        return KVzapRow.totals(num_layers)

    def __init__(self, *, window: int = WINDOW, threshold: float | None = None) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.threshold = threshold


@register_decode_step("kvzap_linear")
class KVzapLinearDecode(KVzapDecode):
    kind = "linear"
