"""The order of a group's collectives, checked across its ranks, and the errors a collective
raises when they disagree: :class:`Arrivals` keeps each rank's position in the group's c10d
store (one sequence per group, shared by every Collectives object built on it), so that ranks
in different collectives fail naming both; a timeout names the ranks that never came and a
lost connection the peer (and node) that went away. tiertrain/comm.py's Collectives use it.
"""
from __future__ import annotations

import os
import re
import threading
import weakref

import torch.distributed as dist

from .errors import TiertrainError


class CollectiveMismatchError(TiertrainError, RuntimeError):
    """Ranks issued different collectives (e.g. took different branches under ZeRO-3)."""

    message_is_diagnosis = True


class CollectiveTimeout(TiertrainError, RuntimeError):
    """A collective did not complete within the run's timeout. ``rank`` (global) timed out
    waiting for ``waiting_for``; ``missing_ranks`` (global) are the ranks of the group that
    had not issued that collective when the wait ended (empty when all had: the transfer
    itself stalled, e.g. a peer stopped or a link died mid-way)."""

    message_is_diagnosis = True

    def __init__(self, message: str, rank: int, waiting_for: str, missing_ranks: list[int]):
        super().__init__(message)
        self.rank = rank
        self.waiting_for = waiting_for
        self.missing_ranks = missing_ranks


class PeerLost(TiertrainError, RuntimeError):
    """A collective failed because a peer's connection closed (its process or its node died).
    ``rank`` (global) is the rank that noticed, ``lost_ranks`` the ranks it lost (global; all
    the group's ranks on other nodes when the peer could not be told apart)."""

    message_is_diagnosis = True

    def __init__(self, message: str, rank: int, waiting_for: str, lost_ranks: list[int]):
        super().__init__(message)
        self.rank = rank
        self.waiting_for = waiting_for
        self.lost_ranks = lost_ranks


_CONNECTION_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe",
                    "connection refused", "read error", "write error")
"""How gloo words a peer that went away (transport/tcp/pair.cc)."""


def _node_of(rank: int) -> int | None:
    """The node (torchrun's GROUP_RANK) a global rank runs on: torchrun numbers ranks node by
    node, LOCAL_WORLD_SIZE per node. None when not known."""
    try:
        return rank // int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError, ZeroDivisionError):
        return None


def is_connection_lost(error: BaseException) -> bool:
    """Whether error is the backend's word for a peer whose connection closed."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(words in text for words in _CONNECTION_LOST)


def peer_lost(error: BaseException, me: int, ranks: list[int], what: str | None = None,
              number: int | None = None) -> PeerLost:
    """The one-line error for a peer whose connection closed: which rank (and node) noticed,
    during what, and which rank(s) and node it lost. gloo names only the peer's address
    (``Connection closed by peer [10.0.0.2]:6788``); the node follows from torchrun's
    numbering (_node_of). ``ranks``: the global ranks of the group the error came from."""
    text = " ".join(str(error).split())
    found = re.search(r"\[([0-9A-Fa-f.:]+)\]:\d+", text)
    address = found.group(1) if found else None
    others = [r for r in ranks if r != me]
    my_node = _node_of(me)
    remote = [r for r in others if _node_of(r) is not None and _node_of(r) != my_node]
    if len(others) == 1:
        lost = others
    elif address and not address.startswith("127.") and remote:
        lost = remote  # another node's address: one of the ranks there
    else:
        lost = others

    def where(r: int) -> str:
        node = _node_of(r)
        return f"rank {r}" + (f" on node {node}" if node is not None and my_node is not None else "")

    nodes = sorted({_node_of(r) for r in lost} - {None, my_node})
    who = ((where(lost[0]) if len(lost) == 1 else f"one of ranks {lost}" if lost else "a peer")
           + (f" ({address})" if address else ""))
    why = f"node {nodes[0]} or its process died?" if len(nodes) == 1 else "its process died?"
    gloo = re.sub(r"^\[[^\]]*\] ", "", text).split(" This is typically")[0]
    during = (f" during {what}" + (f", collective #{number}" if number else "") + f" of the group of ranks {ranks}"
              if what else "")
    head = (f"rank {me}" + (f" (node {my_node})" if my_node is not None else "") +
            f" lost its connection to {who}{during}: {why} ({gloo})")
    return PeerLost(head, me, what or "", lost)


class _Sequence:
    """This process's place in one group's sequence of collectives, shared by every
    Collectives object built on the group (the engine's, the stage-3 constructor's, a delayed
    update's): they all count into one sequence, as the backend does."""

    def __init__(self):
        self.lock = threading.Lock()
        self.issued: int | None = None
        """Collectives this rank issued on the group (None: not read from the store yet)."""
        self.seen: dict[int, str] = {}
        """slot → the value this rank last found in it (Arrivals.issue's compare_set expects it)."""
        self.disabled = False
        """The store failed once, or this rank finished: no more checks on this group (a check
        with a number missed would report ranks that agree as different)."""
        self.arrivals: Arrivals | None = None
        """The first Arrivals built on the group (finish_collectives finishes through it)."""


_SEQUENCES: "weakref.WeakKeyDictionary[dist.ProcessGroup, _Sequence]" = weakref.WeakKeyDictionary()
_SEQUENCES_LOCK = threading.Lock()


def _sequence_of(group: dist.ProcessGroup) -> _Sequence:
    with _SEQUENCES_LOCK:
        sequence = _SEQUENCES.get(group)
        if sequence is None:
            sequence = _SEQUENCES[group] = _Sequence()
        return sequence


class Arrivals:
    """Where each rank of a group is in the group's one sequence of collectives, kept in the
    group's c10d store, so that ranks running different code learn it before they meet in
    different collectives, and a rank whose wait times out can name who never came.

    **Before issuing collective #n** (:meth:`issue`) a rank records its position ("n|what",
    a ``set``, sent without waiting for a reply) and checks slot ``n % SLOTS``: the first rank
    to reach #n writes "n|rank|what" there (``compare_set`` against the value it found in
    that slot at #n - SLOTS), every later one gets that value back and compares. A rank that
    ran out of batches and saves a checkpoint while its peer is still in its gradient
    reduction is stopped at the first collective where the two differ, before issuing it:
    gloo would pair the two (both all_to_all underneath, or sizes that happen to fit) and
    complete them with each other's data, or fail later with an unrelated error. Only
    collectives issued through :class:`Collectives` (and operations it marks with
    :meth:`Collectives.enter`) are compared; raw ``torch.distributed`` calls are not seen.

    **Later**, the positions name the ranks that never issued a collective a wait timed out
    on (even stopped or hung ones, which cannot answer), a peer waiting in a different
    collective (:meth:`different_collective`), and a rank whose program returned
    (:meth:`finish`) while its peers still issue collectives.

    ``what`` must be the same text on every rank for collectives that legitimately match
    (sizes, dtypes, the source's global rank; never this rank's own number).

    Cost: one store round trip per collective (the compare_set; ~25 µs on localhost), what
    the per-rank counter it replaced cost. Store memory: SLOTS keys and one position per
    rank, whatever the run's length. The check runs on every backend: NCCL, too, pairs
    collectives of the same size silently (or hangs until its watchdog's timeout), and the
    round trip is the one every collective already paid for its arrival count. A store that
    fails disables the checks of the group (the run goes on, with plain timeout messages)
    rather than failing the collective."""

    SLOT = "tiertrain/slot/"
    POSITION = "tiertrain/at/"
    DROPPED = "tiertrain/dropped/"
    SLOTS = 1024
    """Slots reused in turn. A rank SLOTS collectives ahead of a peer (async collectives
    never waited for) makes that peer find a newer number in its slot: the check is skipped
    there, never reported as a mismatch."""
    FINISHED = "nothing more: its program returned"
    """A position's ``what`` once :meth:`finish` recorded that this rank is done."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int):
        self.store = group.get_group_store()
        self.rank = rank
        self.size = size
        self.ranks = dist.get_process_group_ranks(group)
        self.sequence = _sequence_of(group)
        if self.sequence.arrivals is None:
            self.sequence.arrivals = self

    @property
    def enabled(self) -> bool:
        return not self.sequence.disabled

    def issue(self, what: str) -> tuple[int, tuple[int, str, int] | None]:
        """Take this rank's next number n for the collective ``what`` about to be issued,
        record it as this rank's position, and compare it with slot n's: returns (n, None),
        or (n, (group rank, its what, its number)) for a peer that issued a different
        collective #n or finished after #n - 1 (then this rank must not issue it). Raises
        when the store fails (the group's checks are disabled first)."""
        seq = self.sequence
        with seq.lock:
            try:
                if seq.issued is None:  # (a group re-created on the same store continues its numbers)
                    seq.issued = self._stored_positions([self.rank])[self.rank][0]
                seq.issued += 1
                number = seq.issued
                self.store.set(f"{self.POSITION}{self.rank}", f"{number}|{what}")
                return number, self._claim(number, what)
            except Exception:
                seq.disabled = True
                raise

    def finish(self) -> None:
        """Record that this rank's program is done with the group: a peer that issues (or
        waits in) a collective this rank never will is told so at once, instead of
        waiting for its timeout. The write is acknowledged before returning (the process
        may exit right after)."""
        seq = self.sequence
        with seq.lock:
            if seq.disabled or seq.issued is None:
                return
            self.store.set(f"{self.POSITION}{self.rank}", f"{seq.issued}|{self.FINISHED}")
            self._claim(seq.issued + 1, self.FINISHED)
            seq.disabled = True  # (nothing more is issued on it from this process)

    def _claim(self, number: int, what: str) -> tuple[int, str, int] | None:
        """compare_set slot ``number``: see the class docstring."""
        seq = self.sequence
        slot = number % self.SLOTS
        key = f"{self.SLOT}{slot}"
        mine = f"{number}|{self.rank}|{what}"
        expected = seq.seen.get(slot, "")
        for _ in range(3):
            current = self.store.compare_set(key, expected, mine).decode(errors="replace")
            found = _number(current)
            if found >= number:
                break
            # The slot holds an older collective than the one this rank last saw there (its
            # first use in this process, or a store written by an earlier group of the same
            # name): claim it from that value. (A missing key makes compare_set answer with
            # the expected value itself: then expect nothing.)
            expected = current if current != expected else ""
        else:
            return None
        if found != number:
            # A peer is SLOTS collectives ahead: no check this time. (What this rank expects in
            # the slot stays the older value, so that at #number + SLOTS it compares again.)
            return None
        seq.seen[slot] = current
        _, peer, theirs = current.split("|", 2)
        if int(peer) == self.rank or theirs == what:
            return None
        return int(peer), theirs, number - 1 if theirs == self.FINISHED else number

    def _stored_positions(self, ranks, prefix: str = POSITION) -> dict[int, tuple[int, str]]:
        """{group rank: (collectives it issued, what the last one was)}; (0, "") for a rank
        that issued none. (With prefix DROPPED: the passes it dropped, the last one.)"""
        out = {}
        for r in ranks:
            key = f"{prefix}{r}"
            value = self.store.get(key).decode(errors="replace") if self.store.check([key]) else ""
            count, _, what = value.partition("|")
            out[r] = (int(count) if count.isdigit() else 0, what)
        return out

    def note_dropped(self, count: int, last: str) -> None:
        """Record that this rank dropped ``count`` passes so far, the last one ``last``
        (Collectives.drop_pass): named in its peers' mismatch messages."""
        self.store.set(f"{self.DROPPED}{self.rank}", f"{count}|{last}")

    def dropped(self) -> dict[int, tuple[int, str]]:
        """Every group rank's (passes dropped, the last one): (0, "") for none."""
        return self._stored_positions(range(self.size), self.DROPPED)

    def positions(self) -> dict[int, tuple[int, str]]:
        """Every group rank's (collectives issued, what the last one was)."""
        return self._stored_positions(range(self.size))

    def counts(self) -> dict[int, int]:
        """Collectives issued so far by each group rank (0 for a rank that issued none)."""
        return {r: count for r, (count, _) in self.positions().items()}

    def different_collective(self, number: int, what: str) -> tuple[int, str, int] | None:
        """Called by a rank whose wait for collective #number (``what``) has gone on for long,
        or whose peer went away: (group rank, what it is in, its number) of a peer at the same
        number in another collective, or done with the group (what = FINISHED) — the ranks
        run different code: one ran out of batches, or took a branch the others did not —
        else None."""
        for r, (count, theirs) in self.positions().items():
            if r == self.rank:
                continue
            if theirs == self.FINISHED and count < number or count == number and theirs != what:
                return r, theirs, count
        return None


def _number(value: str) -> int:
    """The collective number a slot's value starts with (-1 for none)."""
    head = value.split("|", 1)[0]
    return int(head) if head.isdigit() else -1


def finish_collectives() -> None:
    """This process's program is done: record it in every group it issued collectives on
    (Arrivals.finish), so that a peer still issuing some fails at once naming this rank, not
    after its timeout. tiertrain.launch calls it when a rank's function returns; a store
    that is gone already is ignored."""
    with _SEQUENCES_LOCK:
        sequences = list(_SEQUENCES.values())
    for sequence in sequences:
        try:
            sequence.arrivals.finish()
        except Exception:  # noqa: BLE001 - best effort at exit: the peer then sees a lost connection
            pass


__all__ = ["Arrivals", "CollectiveMismatchError", "CollectiveTimeout", "PeerLost", "finish_collectives",
           "is_connection_lost", "peer_lost"]
