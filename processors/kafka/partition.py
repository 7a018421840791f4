"""One owned input partition: its projection, its fold, and what it produced since the last checkpoint."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from branch_settlement.processors.ledger.fold import Fold
from branch_settlement.processors.ledger.outputs import DEAD_LETTER_TOPIC, Outputs, output_encoder
from branch_settlement.projections import keys, model
from branch_settlement.projections.store import RocksStore
from branch_settlement.projections.view import LedgerView
from branch_settlement.schemas import native
from branch_settlement.schemas.codec import Codec
from branch_settlement.processors.kafka.errors import ProjectionsNotFound
from branch_settlement.processors.kafka.ticks import TICKS_TOPIC, anchor_key
from branch_settlement.schemas.limits import DEAD_LETTER_ORIGINAL_BYTES, MAX_KEY_BYTES

# The next input offset the projection covers: written with every checkpoint's ledger changes, in the
# changelog and in the store, so a restore knows when it has caught up with the committed offsets.
INPUT_POSITION_KEY = keys.META + keys.SEP + b"input_position"


def input_position(store) -> int | None:
    raw = store.get(INPUT_POSITION_KEY)
    return None if raw is None else int(raw)


# The state directory's layout, defined here only: <state dir>/<group id>/partition-<N>, one projection each.
_PROJECTION_PREFIX = "partition-"


def group_dir(state_dir: str, group_id: str) -> Path:
    """Where a processor of `group_id` keeps its projections."""
    return Path(state_dir) / group_id


def store_path(state_dir: str, group_id: str, partition: int) -> Path:
    return group_dir(state_dir, group_id) / f"{_PROJECTION_PREFIX}{partition}"


def stored_partitions(state_dir: str, group_id: str) -> dict[int, Path]:
    """The projections a processor left in the state directory, by partition. Raises ProjectionsNotFound
    when there is no such directory."""
    root = group_dir(state_dir, group_id)
    if not root.is_dir():
        raise ProjectionsNotFound(f"no projections under {root}: is --state-dir/--group-id the processor's?")
    found = {}
    for path in root.glob(f"{_PROJECTION_PREFIX}*"):
        suffix = path.name[len(_PROJECTION_PREFIX):]
        if suffix.isdigit():
            found[int(suffix)] = path
    return dict(sorted(found.items()))


class PartitionTask:
    def __init__(self, partition: int, store: RocksStore, codec: Codec, committed_position: int,
                 partitions: int) -> None:
        self.partition = partition
        self.store = store
        self.codec = codec
        self.view = LedgerView(store, codec.encode, codec.decode)
        # A fold of one partition of the input topic: misrouted events and Ticks among the input change nothing.
        self.fold = Fold(self.view, partition, partitions)
        self.out = Outputs()  # what the event being folded produces; encoded into `records` right after
        self._encode_outputs = output_encoder(codec)
        # Everything produced since the last checkpoint, encoded, in input order: (logical topic, key, value).
        self.records: list[tuple[str, bytes | None, bytes]] = []
        self.produced = 0  # how many of `records` are in the open transaction already (checkpoint.produce_folded)
        self.results = 0  # events folded since the last checkpoint
        self.dead_letters = 0
        self.released: dict[tuple[str, str], int] = {}  # (dimension, destination) -> quantity, uncommitted
        # Next input offset to commit once the buffered work is committed; None: nothing folded since.
        self.position: int | None = None
        # Next input offset the group has committed: where to rewind after an abort.
        self.committed_position = committed_position
        # Next input offset expected from the consumer: an older message (redelivered around a rebalance
        # or a rewind) is dropped, never folded twice.
        self.next_offset = committed_position
        self.stopped: str | None = None  # why, when an invariant violation stopped the partition
        # Set by a checkpoint that failed because one of this partition's records was too large to produce.
        self.too_large: str | None = None
        self.last_tick_ms = 0
        # For the metrics, from the committed ledger: per parent that lent and is not closed, what its open loans
        # hold (`lent` per dimension), how many are open and how many of those were asked back; and how many
        # loans committed checkpoints asked back since the last `take_revocations_asked`.
        self.loans: dict[str, dict] = {}
        self._revocations_asked = 0
        # What each parent that is not closed adds to `capacity`, as last committed: a checkpoint that changes it
        # takes the old terms from here rather than reading and decoding its stored record (a closed parent never
        # changes again but to be deleted, when it is read).
        self._parent_terms: dict[bytes, dict[tuple[str, str], int]] = {}
        self.capacity = self._capacity_from_store()

    def has_work(self) -> bool:
        return self.position is not None or bool(self.records)

    def buffered(self) -> int:
        """Records the next checkpoint will produce for this partition: outputs and ledger changes."""
        return len(self.records) + self.view.change_count()

    def apply(self, event: dict, offset: int, ledger_tick: bool = False) -> dict:
        """Fold one event and encode its outputs at once, in input order: the checkpoint then only produces
        (shorter transactions), and each output partition carries its records in input order. An encoding
        failure raises like a failure of the fold: a bug, never bad input."""
        result = self.fold.apply(event, offset, self.out, ledger_tick)
        self._encode_outputs(self.out, self.records, self.released)
        self.results += 1
        return result

    def fast_parts(self) -> tuple | None:
        """What the compiled per-message loop (native/src/batch.rs) folds this partition's events with: (this task,
        its fold, the fold's compiled core, its Outputs, its compiled output encoder). None where any of them is
        Python, or `apply` or the fold's is not the class's own (a simulation or a profile replaced it): then
        every event goes through `apply`."""
        fold, encoder = self.fold, self._encode_outputs
        core = getattr(fold, "_core", None)
        if (core is None or type(self).apply is not _APPLY or "apply" in vars(self)
                or type(fold).apply is not Fold.apply or "apply" in vars(fold)
                or not isinstance(encoder, native.module().OutputEncoder)):
            return None
        return self, fold, core, self.out, encoder

    def fold_tick(self, tick: dict) -> dict:
        """Fold one of the processor's own ticks here, before the next input offset, and buffer it for
        ledger-ticks keyed by that offset (processors/kafka/ticks.py). A tick commits the input position too:
        every checkpoint sends the group's offsets, which fences a zombie's (KIP-447)."""
        anchor = max(self.next_offset, 0)
        result = self.apply(tick, anchor, ledger_tick=True)
        self.records.append((TICKS_TOPIC, anchor_key(anchor), self.codec.encode_event(tick)))
        if self.position is None:
            self.position = anchor
        return result

    def dead_letter(self, key: bytes | None, letter: dict) -> None:
        # An oversized record's dead letter must still fit the topic: its head (the reason the codec gave names
        # its size and digest), under a key of bounded size.
        if len(letter["original"]) > DEAD_LETTER_ORIGINAL_BYTES:
            letter = dict(letter, original=letter["original"][:DEAD_LETTER_ORIGINAL_BYTES])
        if key is not None and len(key) > MAX_KEY_BYTES:
            key = key[:MAX_KEY_BYTES]
        self.records.append((DEAD_LETTER_TOPIC, key, self.codec.encode("DeadLetter", letter)))
        self.dead_letters += 1

    def discard(self) -> None:
        """Forget everything since the last commit (after an abort): the projection is as committed."""
        self.view.discard()
        self._clear()

    def _clear(self) -> None:
        self.out.clear()
        self.records.clear()
        self.produced = 0
        self.results = self.dead_letters = 0
        self.released = {}
        self.position = None

    def forget_committed(self) -> dict[tuple[str, str], int]:
        """The transaction committed: the buffers are durable in Kafka, so nothing here may be committed
        again, whatever happens next. Returns the quantities it released, by dimension and destination."""
        self.view.mark_committed()
        if self.position is not None:
            self.committed_position = self.position
        released = self.released
        self._clear()
        return released

    def write_committed(self, changes: list, changelog_offset: int | None) -> None:
        """Then the projection batch, with the changelog offset it brings the store up to."""
        if changes:
            self._update_capacity(changes)
            self.store.write(changes, changelog_offset)

    def close(self) -> None:
        self.store.close()

    # -- capacity totals for the metrics: summed over this partition's parents ---------------------------

    def _capacity_from_store(self) -> dict[tuple[str, str], int]:
        totals: dict[tuple[str, str], int] = {}
        for key, raw in self.store.scan(keys.prefix(keys.PARENT)):
            parent = self.codec.decode(raw)[1]
            self._add(totals, self._remember_terms(key, parent), 1)
            self._track_loans(parent, count=False)
        return totals

    def _remember_terms(self, key: bytes, parent: dict) -> dict[tuple[str, str], int]:
        terms = model.balance_terms(parent)
        if parent["status"] != model.PARENT_CLOSED:
            self._parent_terms[key] = terms
        return terms

    def _track_loans(self, parent: dict, count: bool = True) -> None:
        before = self.loans.pop(parent["parent_id"], None)
        loans = parent.get("loans")
        if not loans:
            return
        lent: dict[str, int] = {}
        open_loans = outstanding = asked = 0
        for loan in loans:
            asked += loan["revocation_requested"]
            if loan["state"] == model.LOAN_OPEN:
                open_loans += 1
                outstanding += loan["revocation_requested"]
                for dim, quantity in loan["quantities"].items():
                    lent[dim] = lent.get(dim, 0) + quantity
        if count:
            self._revocations_asked += asked - (before["asked"] if before else 0)
        if parent["status"] != model.PARENT_CLOSED:  # a closed parent never changes again
            self.loans[parent["parent_id"]] = {"lent": lent, "open": open_loans, "outstanding": outstanding,
                                               "asked": asked}

    def take_revocations_asked(self) -> int:
        """Loans asked back by the checkpoints committed since the last call."""
        asked, self._revocations_asked = self._revocations_asked, 0
        return asked

    @staticmethod
    def _add(totals: dict, terms: dict[tuple[str, str], int], sign: int) -> None:
        for term, value in terms.items():
            totals[term] = totals.get(term, 0) + sign * value

    def _update_capacity(self, changes: list) -> None:
        prefix = keys.prefix(keys.PARENT)
        for key, value in changes:
            if not key.startswith(prefix):
                continue
            old = self._parent_terms.pop(key, None)
            if old is None:  # new, or closed
                stored = self.store.get(key)
                if stored is not None:
                    old = model.balance_terms(self.codec.decode(stored)[1])
            if old:
                self._add(self.capacity, old, -1)
            if value is not None:
                parent = self.codec.decode(value)[1]
                self._add(self.capacity, self._remember_terms(key, parent), 1)
                self._track_loans(parent)


# PartitionTask's own apply, as defined here: fast_parts tells it from one a profile put in its place.
_APPLY = PartitionTask.apply


def delete_store(state_dir: str, group_id: str, partition: int) -> None:
    shutil.rmtree(store_path(state_dir, group_id, partition))


def open_store(state_dir: str, group_id: str, partition: int) -> RocksStore:
    path = store_path(state_dir, group_id, partition)
    os.makedirs(path.parent, exist_ok=True)
    return RocksStore(path)
