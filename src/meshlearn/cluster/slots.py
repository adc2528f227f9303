"""Slot authority: in an elastic cluster run, which host holds each worker slot now, kept by the
coordinator's control service, and what holding a slot lets a host write there.

Why: the placement says which host runs a worker when the run starts, but under elastic membership
a slot changes hands — its holder leaves, a joiner on any host takes it over. If the owner rules
went by the placement, a joiner could write nothing of its own, and the placement's host could
go on writing records for a slot it no longer holds. So the owner of a slot's records (its
heartbeat, its progress, its events, its votes and quorum entries, its links' meeting marks) is
the slot's *current holder*, and only a claim moves a slot:

- a claim is the compare-and-set of ``elastic/taken/<slot>/<g>`` from empty to a value naming the
  claimant's own TLS identity, ``<host>:<pid>``; it is refused unless generation ``g`` is the
  slot's current one and has left (``elastic/free/<slot>/<g>`` exists: set by the leaving holder's
  host, or by the coordinator). Two claimants race on the compare-and-set; only the winner moves
  the slot. Nobody can claim a slot for another host, nor a slot whose holder is still in it.
- once the compare-and-set went through, the service moves the slot to the claimant at generation
  ``g + 1`` and publishes it under ``elastic/holder/<slot>`` (``<host>.<generation>``), a key only
  the service writes: every process's connector reads it to find the host a slot's process now
  runs on (``cluster/links.py``), and every host's launcher to find the joiners it must watch.

A *newcomer* — a joiner whose certificate says ``joiner`` (``meshlearn keys --add``), a machine
outside ``[cluster.hosts]`` — claims as a host does, with three more rules, because the run knows
nothing of it but its certificate:

- its claim carries its one inbound port, ``<name>:<pid>@<address>:<port>``: the service
  publishes it under ``elastic/address/<name>`` (a key only the service writes), so the members
  that must connect to it learn its address from the run, attached to the claim its own
  certificate made — nobody can state an address for another identity. A host's claim carries
  none (its address is the placement's);
- it holds at most one slot: a second claim, while it holds another, is refused (a newcomer runs
  one process; two slots would let one stranger stand for two replicas of a stage);
- where ``verify.trusted_ends`` assumes the first and last stages honest, it may not claim a
  slot of those stages (``ends``): only a host the owner marked ``trusted`` may run them there
  (the compat row of ``cluster.hosts.X.trusted``), and a newcomer is nobody's vouched-for machine.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from meshlearn.mesh.topology import WorkerId

SLOT = re.compile(r"r\d+s\d+\Z")
ADDRESS = re.compile(r"\A[0-9A-Za-z.:-]{1,253}\Z")  # an IP address (v4 or v6) or a DNS name
WORKERS_NAMESPACE = "meshlearn/0//"  # the workers' keys, as ``health.store_client`` prefixes them


def holder_key(slot: str) -> str:
    """Where the control service publishes ``slot``'s holder, in the workers' namespace (as a
    process reads it through ``store_client``)."""
    return f"elastic/holder/{slot}"


def address_key(name: str) -> str:
    """Where the control service publishes a newcomer's inbound port (ADDR:PORT), in the workers'
    namespace."""
    return f"elastic/address/{name}"


def claim_value(host: str, pid: int, address: tuple[str, int] | None = None) -> str:
    """What a claimant writes into the taken key: its own identity and its process, and a
    newcomer's inbound port."""
    return f"{host}:{pid}" + (f"@{address[0]}:{address[1]}" if address else "")


def parse_claim(value: str) -> tuple[str, int]:
    """(host, pid) of a claim's value; ValueError when it is none."""
    return _parse_claim(value)[:2]


def claim_address(value: str) -> tuple[str, int] | None:
    """The inbound port a newcomer's claim carries (None: it carries none); ValueError when the
    value is no claim."""
    return _parse_claim(value)[2]


def _parse_claim(value: str) -> tuple[str, int, tuple[str, int] | None]:
    claim, at, where = value.partition("@")
    host, _, pid = claim.rpartition(":")
    if not host or not pid.isdigit():
        raise ValueError(f"{value!r} is no claim (HOST:PID)")
    if not at:
        return host, int(pid), None
    address, _, port = where.rpartition(":")
    if not ADDRESS.match(address) or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{value!r} carries no inbound port (NAME:PID@ADDR:PORT)")
    return host, int(pid), (address, int(port))


def parse_holder(value: str) -> tuple[str, int]:
    """(host, generation) of a published holder."""
    host, _, generation = value.rpartition(".")
    return host, int(generation)


@dataclass
class Holder:
    host: str
    generation: int


class SlotTable:
    """Each worker slot's holder. ``placed``: every worker slot → the host the placement gives it
    (generation 0); ``coordinator``: the host that may free any slot (its machine holds the run);
    ``ends``: the stages a newcomer may not hold (the first and last where ``verify.trusted_ends``
    trusts them). ``newcomers``: the admitted newcomers (joiner certificates of the run)."""

    def __init__(self, placed: Mapping[str, str], coordinator: str, ends: frozenset[int] = frozenset()):
        self.holders = {slot: Holder(host, 0) for slot, host in placed.items() if SLOT.match(slot)}
        self.coordinator = coordinator
        self.ends = ends
        self.newcomers: set[str] = set()

    def admit(self, name: str) -> None:
        """``name`` proved a joiner's certificate of the run: it may claim (``claim_refusal``)."""
        self.newcomers.add(name)

    def __contains__(self, slot: str) -> bool:
        return slot in self.holders

    def host(self, slot: str) -> str | None:
        holder = self.holders.get(slot)
        return holder.host if holder else None

    def holds(self, who: str, slot: str, generation: int | None = None) -> bool:
        """Whether ``who`` holds ``slot`` (at ``generation``, when given)."""
        holder = self.holders.get(slot)
        return holder is not None and holder.host == who and generation in (None, holder.generation)

    def holds_stage(self, who: str, stage: int) -> bool:
        return any(h.host == who and WorkerId.parse(slot).stage == stage for slot, h in self.holders.items())

    def holds_any(self, who: str) -> bool:
        return any(h.host == who for h in self.holders.values())

    def may_free(self, who: str, slot: str, generation: int) -> bool:
        """The holder's host frees its own generation (its launcher saw the process end); the
        coordinator may free any (a machine that is gone frees nothing)."""
        return self.holds(who, slot, generation) or (slot in self.holders and who == self.coordinator)

    def claim_refusal(self, who: str, slot: str, generation: int, desired: bytes,
                      has: Callable[[list[str]], bool]) -> str | None:
        """Why ``who`` may not claim generation ``generation`` of ``slot`` with ``desired`` (None:
        it may); ``has``: whether keys exist in the control state."""
        holder = self.holders.get(slot)
        if holder is None:
            return f"{slot!r} is no worker slot of this run"
        try:
            host, _, address = _parse_claim(desired.decode(errors="replace"))
        except ValueError as err:
            return f"a claim of {slot} must name its claimant as HOST:PID ({err})"
        if host != who:
            return f"host {who} may claim {slot} only for itself, not for {host}"
        why = self._newcomer_refusal(who, slot, address, has)
        if why is not None:
            return why
        if generation != holder.generation:
            return f"{slot} is at generation {holder.generation}, not {generation}"
        if not has([f"{WORKERS_NAMESPACE}elastic/free/{slot}/{generation}"]):
            return f"{slot} is held by {holder.host} (generation {generation} has not left)"
        return None

    def _newcomer_refusal(self, who: str, slot: str, address: tuple[str, int] | None,
                          has: Callable[[list[str]], bool]) -> str | None:
        """The rules a newcomer's claim obeys beyond a host's (the module's docstring). A slot it
        held whose generation has left (freed) no longer counts against its one slot."""
        if who not in self.newcomers:
            return None if address is None else (f"host {who} claims with its placement's address, not "
                                                 f"{address[0]}:{address[1]}")
        if address is None:
            return f"newcomer {who} must attach its inbound port to its claim of {slot} (NAME:PID@ADDR:PORT)"
        held = [s for s, h in self.holders.items() if h.host == who and s != slot
                and not has([f"{WORKERS_NAMESPACE}elastic/free/{s}/{h.generation}"])]
        if held:
            return f"newcomer {who} holds {held[0]} already: a newcomer holds one slot"
        stage = WorkerId.parse(slot).stage
        if stage in self.ends:
            return (f"newcomer {who} may not hold {slot}: verify.trusted_ends assumes stage {stage} "
                    "honest, so only a host marked trusted runs it")
        return None

    def take(self, who: str, slot: str, generation: int, desired: bytes = b"") -> dict[str, str]:
        """The claim went through: ``who`` holds ``slot`` at ``generation + 1``; returns the keys to
        publish: the slot's holder (``parse_holder``) and a newcomer's inbound port."""
        self.holders[slot] = Holder(who, generation + 1)
        published = {WORKERS_NAMESPACE + holder_key(slot): f"{who}.{generation + 1}"}
        if who in self.newcomers:
            address = claim_address(desired.decode(errors="replace"))
            assert address is not None, "claim_refusal let no newcomer's claim through without its port"
            published[WORKERS_NAMESPACE + address_key(who)] = f"{address[0]}:{address[1]}"
        return published

    def published(self) -> dict[str, str]:
        """Every slot's holder key (in the workers' namespace) → its published value."""
        return {WORKERS_NAMESPACE + holder_key(slot): f"{h.host}.{h.generation}"
                for slot, h in self.holders.items()}
