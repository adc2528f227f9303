"""Who may write which key of a cluster run's control state (``cluster/control.py`` asks).

The control service knows who is asking (the TLS identity: a host of ``[cluster.hosts]``) and,
from the placement, which host runs which process (rank). Every key family the runtime uses has
an owner rule; a key of no family is refused, to read as to write (a key nobody reads is a place
to smuggle state; a key nobody writes is a read that can only wait). Reads of a known family are
open to every host of the run: the control state is the run's shared view, and its writes are
what is guarded.

Owners, by family (keys of the workers' namespace ``meshlearn/<restart>//`` and of the
launchers' ``meshlearn-cluster/``):

- a process's own records — heartbeat ``hb/<rank>`` (another host may only create it, adding 0),
  ``done/``, ``joined/``, ``links/``, ``collectives/``, ``anchor/<rank>``, an attacker's
  ``truth/<step>/<worker>`` (the coordinator's records writer deletes it once read),
  checkpoint shard entries and resume lists ``cluster/checkpoint/.../<worker>``: the host that
  runs that rank or worker (a shard entry must be its writer's own word on its own file:
  ``entry_refusal``);
- a host's own records — its checkpoint manifest ``.../host/<host>``, the launcher's
  ``done/<host>``, ``security/<host>`` and ``resume/<host>`` (what its folder holds): that host;
- the run's decisions — the config and tokenizer, the revocation list in force (``REVOCATIONS``:
  every other host applies it, so no host but the coordinator's may say what it is), the
  tokenizer's ``ready``, the checkpoint agreement (in an elastic run: a holder of a last-stage slot,
  which writes the elastic manifest, once, by compare-and-set from empty; every reader checks it
  against the shard entries, ``cluster/elastic_checkpoints.py``) and resume step, the launchers'
  resume choice, the records writer's drain marks, state requests and resume state: the coordinator
  (which runs the records writer); rank 0's tokenizer mark: rank 0's host;
- the verifier's verdicts and states: the verifier's host (the coordinator and the verifier's
  host may delete what they have read);
- ``abort`` and the graceful-stop ``drain``: any host, by compare-and-set (a drain value only in
  the two forms every process parses, its step never moved back, a stop final:
  ``drain_refusal``); an abort is stored
  as the writer's report (``attributed``), so it can never read as another participant's words,
  and an abort that speaks for a process of another host is refused (``speaker_refusal``): the
  runtime's aborts name their speaker — ``worker r0s1 failed: …`` (its own failure), ``… (noticed
  by r0s1)`` (what it observed) — and a host may speak only for the processes it runs;
- a process group's own rendezvous (``pg/``): any host, only when the run declares its links
  trusted (``dist.trusted_links``), the one case where hosts trust each other's bytes anyway;
- in an elastic run (``slots``: ``cluster/slots.py``), a worker slot's records — its rank's heartbeat and
  marks above, ``progress/<slot>``, ``elastic/{joined,finished,ended,events,gen}/<slot>…``, its checkpoint
  mark, its row agreement entry, its stage quorum's heartbeat and arrival ``…/<slot>.<generation>``, its
  links' meeting mark: the slot's *current holder*, not the placement's host; a stage's shared tallies
  (``elastic//rows/…/s<stage>/``, ``elastic//commit/…/s<stage>/``, ``elastic/q/s<stage>/``): a holder of a
  slot of that stage; a step's decisions (rows fixed, commit decision, the peer vote's decision after a
  failed stream, a row's links dropped, ``elastic/started``): any slot holder; the records' claim
  ``records/<step>``: a holder of a last-stage slot; ``elastic/free/<slot>/<g>``: generation g's holder (its
  launcher) or the coordinator; ``elastic/taken/<slot>/<g>``: a claim, checked by the slot table
  (``claim_refusal``); ``elastic/holder/<slot>`` and a newcomer's ``elastic/address/<name>``: nobody
  (the service publishes them).

Newcomers (``admission_refusal``): in an elastic run, a peer whose certificate of the run's CA says
``joiner`` (``meshlearn keys --add``; a revoked one never finishes its handshake) is admitted as a
participant outside the placement. It reads what every host reads (the config, the tokenizer, the
holders) and writes by the same rules, which give it nothing until it holds a slot: then exactly
that slot's records. How it may claim (one slot, its port attached, no trusted end): ``slots.py``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from meshlearn.cluster.slots import SlotTable
from meshlearn.net.keys import Identity

WORKERS = re.compile(r"meshlearn/\d+//(?P<rest>.+)\Z")  # what health.store_client's PrefixStore makes
LAUNCHERS = "meshlearn-cluster/"  # cluster/shared.py's KEYS
REVOCATIONS = LAUNCHERS + "revocations"  # the list in force, as the coordinator publishes it
ABORT = "abort"
WRITES = ("set", "add", "compare_set", "delete_key")
# who an abort says is speaking: "worker r0s1 failed: …", "the verifier failed: …", "anchor a0s1
# failed: …" (a process's own failure) and "noticed by r0s1" (what it observed), as the runtime writes them
SPEAKERS = re.compile(r"\A(?:worker |anchor |the )?(?P<name>[A-Za-z0-9_-]+) failed:"
                      r"|noticed by (?:the )?(?P<by>[A-Za-z0-9_-]+)")
READS = ("get", "check", "wait", "multi_get", "num_keys")
CLAIM = re.compile(r"elastic/taken/(?P<worker>r\d+s\d+)/(?P<gen>\d+)\Z")


@dataclass(frozen=True)
class Family:
    """A key family: its pattern (of the key inside its namespace) and who may do which write."""

    pattern: re.Pattern
    may: Callable[[Authority, str, str, re.Match, int], bool]  # (authority, writer, op, match, amount)


def _owner_of_rank(op_allowed: tuple[str, ...]):
    return lambda a, who, op, m, n: op in op_allowed and a.host_of_rank(int(m["rank"])) == who


def _owner_of_worker(a, who, op, m, n) -> bool:
    return op == "set" and a.host_of(m["worker"]) == who


def _coordinator(a, who, op, m, n) -> bool:
    return op == "set" and who == a.coordinator


def _agreement(a, who, op, m, n) -> bool:
    """A checkpoint's agreement: the coordinator's; in an elastic run the manifest's writer, a
    holder of a last-stage slot wherever it runs (``cluster/elastic_checkpoints.py``)."""
    if a.slots is None:
        return op == "set" and who == a.coordinator
    return op == "compare_set" and a.slots.holds_stage(who, a.stages - 1)  # once (WRITE_ONCE)


def _that_host(a, who, op, m, n) -> bool:
    return op == "set" and m["host"] == who


def _verifier_posts(a, who, op, m, n) -> bool:
    """The verifier's host posts; the coordinator (the records writer) deletes what it has read."""
    return (op == "set" and who == a.verifier_host) or (op == "delete_key" and who in (a.verifier_host,
                                                                                       a.coordinator))


def _coordinator_posts(a, who, op, m, n) -> bool:
    """The coordinator (records writer) posts; the verifier's host deletes what it has read."""
    return (op == "set" and who == a.coordinator) or (op == "delete_key" and who == a.verifier_host)


def _heartbeat(a, who, op, m, n) -> bool:
    # every process creates every counter of the run's ranks (``Health.start`` adds 0); only the
    # owner moves its own; a rank the run does not have is a key to fill the service with
    owner = a.host_of_rank(int(m["rank"]))
    return op == "add" and owner is not None and (n == 0 or owner == who)


def _anyone_compare_set(a, who, op, m, n) -> bool:
    return op == "compare_set"


def _truth(a, who, op, m, n) -> bool:
    """The attacker's host posts; the coordinator, whose records writer reads it, deletes it."""
    return _owner_of_worker(a, who, op, m, n) or (op == "delete_key" and who == a.coordinator)


def _rank0(a, who, op, m, n) -> bool:
    return op == "set" and a.rank_host.get(0) == who


def _trusted(a, who, op, m, n) -> bool:
    return a.trusted_groups


def _slot_holder(ops: tuple[str, ...]):
    """The slot's current holder (of generation ``gen``, where the key names one)."""
    def may(a, who, op, m, n) -> bool:
        gen = m.groupdict().get("gen")
        return (op in ops and a.slots is not None
                and a.slots.holds(who, m["worker"], None if gen is None else int(gen)))
    return may


def _stage_holder(ops: tuple[str, ...]):
    return lambda a, who, op, m, n: (op in ops and a.slots is not None
                                     and a.slots.holds_stage(who, int(m["stage"])))


def _any_holder(ops: tuple[str, ...]):
    return lambda a, who, op, m, n: op in ops and a.slots is not None and a.slots.holds_any(who)


def _quorum_heartbeat(a, who, op, m, n) -> bool:
    """A stage member's beat: its holder moves it; a member of the stage may only create it."""
    if op != "add" or a.slots is None:
        return False
    stage = int(m["stage"])
    slot_of_stage = m["worker"] in a.slots and int(m["worker"].rsplit("s", 1)[1]) == stage
    return a.slots.holds(who, m["worker"], int(m["gen"])) or (
        n == 0 and slot_of_stage and a.slots.holds_stage(who, stage))


def _counter(owner):
    """A counter its owner moves and anyone reads by adding 0 (a launcher following a slot's events),
    for a slot of the run only: a slot it does not have is a key to fill the service with."""
    return lambda a, who, op, m, n: ((op == "add" and n == 0 and a.slots is not None
                                      and m["worker"] in a.slots) or owner(a, who, op, m, n))


def _tally(a, who, op, m, n) -> bool:
    """A stage's tally: each holder of the stage counts itself once (adds 0 or 1), never resets it."""
    return op == "add" and n in (0, 1) and a.slots is not None and a.slots.holds_stage(who, int(m["stage"]))


def _nobody(a, who, op, m, n) -> bool:
    return False


def _free(a, who, op, m, n) -> bool:
    return op == "set" and a.slots is not None and a.slots.may_free(who, m["worker"], int(m["gen"]))


def _claim(a, who, op, m, n) -> bool:
    """Any host may try; ``Authority.claim_refusal`` checks the value and the slot."""
    return op == "compare_set" and a.slots is not None


def _last_stage_holder(a, who, op, m, n) -> bool:
    return op == "compare_set" and a.slots is not None and a.slots.holds_stage(who, a.stages - 1)


SHARD_ENTRY = re.compile(r"cluster/checkpoint/\d+/shard/[A-Za-z0-9_-]+\Z")
MAX_ENTRY = 512  # bytes of a shard entry: its host's name, a size and a hash fit well within
SHA256 = re.compile(r"[0-9a-f]{64}\Z")


def _entry_ok(value: bytes, host: str | None) -> bool:
    """Whether ``value`` is a shard entry naming ``host`` (None: naming no host)."""
    try:
        entry = json.loads(value)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    want = {"size", "sha256"} | ({"host"} if host is not None else set())
    return (isinstance(entry, dict) and set(entry) == want and entry.get("host") == host
            and type(entry["size"]) is int and entry["size"] >= 0
            and isinstance(entry["sha256"], str) and SHA256.match(entry["sha256"]) is not None)


NAME = r"[A-Za-z0-9_-]+"
WRITE_ONCE = re.compile(  # decided once, by the first compare-and-set from empty; never moved after
    r"(records/\d+|elastic/taken/r\d+s\d+/\d+|elastic/q/s\d+/at/\d+"
    r"|elastic//(rows/\d+/fixed|(commit|pvote)/\d+/decision)|cluster/checkpoint/\d+/agreed)\Z")
DRAIN = re.compile(r"(?:f:(?P<claimed>[0-9]{1,18})|s:(?P<stop>[0-9]{1,18}):[0-9]{1,3})\Z")
"""The graceful stop's key (``train/signals.py``): ``f:<step>``, the highest step claimed, or
``s:<step>:<signal>``, stop after that step; every process parses it at every step's end."""
SLOT = r"(?P<worker>r\d+s\d+)"
GEN = r"(?P<gen>\d+)"
STAGE = r"s(?P<stage>\d+)"
SET, ADD, CAS = ("set",), ("add",), ("compare_set",)
ELASTIC_FAMILIES = (  # elastic/… (``elastic/worker.py``, ``driver.py``, ``rows.py``, ``quorum.py``, …)
    Family(re.compile(rf"progress/{SLOT}\Z"), _slot_holder(SET)),
    Family(re.compile(rf"elastic/(joined|finished|ended)/{SLOT}/{GEN}\Z"), _slot_holder(SET)),
    Family(re.compile(rf"elastic/events/{SLOT}/{GEN}/\d+\Z"), _slot_holder(SET)),
    Family(re.compile(rf"elastic/events/{SLOT}/{GEN}/count\Z"), _counter(_slot_holder(ADD))),
    Family(re.compile(rf"elastic/banned/{SLOT}/{GEN}\Z"), _nobody),  # SENTINEL's: not in a cluster run
    Family(re.compile(rf"elastic/(gen|checkpoint/\d+)/{SLOT}\Z"), _slot_holder(SET)),
    Family(re.compile(rf"elastic/free/{SLOT}/{GEN}\Z"), _free),
    Family(re.compile(rf"elastic/taken/{SLOT}/{GEN}\Z"), _claim),
    Family(re.compile(r"elastic/started\Z"), _any_holder(ADD)),
    Family(re.compile(rf"elastic//rows/\d+/links/{SLOT}\Z"), _slot_holder(SET)),
    Family(re.compile(rf"elastic//(rows|commit)/\d+/{STAGE}/n\Z"), _stage_holder(SET)),
    Family(re.compile(rf"elastic//(rows|commit)/\d+/{STAGE}/(count|yes|done)\Z"), _tally),
    Family(re.compile(r"elastic//(rows/\d+/fixed|(commit|pvote)/\d+/decision)\Z"), _any_holder(CAS)),
    Family(re.compile(rf"elastic/q/{STAGE}/hb/{SLOT}\.{GEN}\Z"), _quorum_heartbeat),
    Family(re.compile(rf"elastic/q/{STAGE}/at/\d+/in/{SLOT}\.{GEN}\Z"), _slot_holder(SET)),
    Family(re.compile(rf"elastic/q/{STAGE}/(joins|latest|join/\d+|at/\d+)\Z"),
           _stage_holder(SET + ADD + CAS)),
    Family(re.compile(rf"elastic/links/[0-9a-z.-]+/\d+/here/{SLOT}\Z"), _slot_holder(SET)),
    Family(re.compile(r"elastic/links/[0-9.]+/\d+/dropped\Z"), _any_holder(SET + CAS)),
    Family(re.compile(r"elastic/holder/r\d+s\d+\Z"), _nobody),  # the service publishes it
    Family(re.compile(r"elastic/address/[A-Za-z0-9._-]+\Z"), _nobody),  # likewise (a newcomer's claim)
    Family(re.compile(r"records/\d+\Z"), _last_stage_holder),
)
WORKER_FAMILIES = (
    Family(re.compile(r"hb/(?P<rank>\d+)\Z"), _heartbeat),
    Family(re.compile(rf"{ABORT}\Z"), _anyone_compare_set),
    Family(re.compile(r"drain\Z"), _anyone_compare_set),
    Family(re.compile(r"(done|joined|anchor|links|collectives)/(?P<rank>\d+)\Z"), _owner_of_rank(("set",))),
    Family(re.compile(r"tokenizer/ready\Z"), _rank0),
    Family(re.compile(r"verdict/\d+\Z"), _verifier_posts),
    Family(re.compile(r"state/\d+\Z"), _verifier_posts),
    Family(re.compile(r"drained/\d+\Z"), _coordinator_posts),
    Family(re.compile(r"state_request\Z"), _coordinator_posts),
    Family(re.compile(r"resume_state\Z"), _coordinator),
    Family(re.compile(rf"truth/\d+/(?P<worker>{NAME})\Z"), _truth),
    Family(re.compile(r"cluster/checkpoint/\d+/agreed\Z"), _agreement),
    Family(re.compile(r"cluster/checkpoint/resume/step\Z"), _coordinator),
    Family(re.compile(rf"cluster/checkpoint/\d+/host/(?P<host>{NAME})\Z"), _that_host),
    Family(re.compile(rf"cluster/checkpoint/(\d+/shard|resume)/(?P<worker>{NAME})\Z"), _owner_of_worker),
    Family(re.compile(r"pg/.+\Z", re.DOTALL), _trusted),
    *ELASTIC_FAMILIES,
)
LAUNCHER_FAMILIES = (
    Family(re.compile(r"(config|tokenizer|tokenizer_sha256|revocations)\Z"), _coordinator),
    Family(re.compile(rf"(done|security|resume)/(?P<host>{NAME})\Z"), _that_host),
    Family(re.compile(r"resume\Z"), _coordinator),
)


class Authority:
    """The owner rules of one run's placement. ``hosts_of``: every process → its host;
    ``ranks``: every process → its rank; ``verifier_host``: where the SENTINEL verifier runs (None:
    no verifier); ``trusted_groups``: the run declares its links trusted (process groups);
    ``elastic``: the run's slots change hands (``slots``: who holds each now); ``stages``: the
    mesh's; ``hosts``: every host of the placement (default: those that run a process);
    ``trusted_ends``: ``verify.trusted_ends`` assumes the first and last stages honest (a newcomer
    may hold neither)."""

    def __init__(self, hosts_of: Mapping[str, str], ranks: Mapping[str, int], coordinator: str,
                 trusted_groups: bool = False, elastic: bool = False, stages: int = 0,
                 hosts: Iterable[str] = (), trusted_ends: bool = False):
        self.hosts_of = dict(hosts_of)
        self.rank_name = {rank: name for name, rank in ranks.items()}
        self.rank_host = {rank: self.hosts_of[name] for name, rank in ranks.items()}
        self.coordinator = coordinator
        self.verifier_host = self.hosts_of.get("verifier")
        self.trusted_groups = trusted_groups
        self.hosts = set(self.hosts_of.values()) | {coordinator} | set(hosts)
        ends = frozenset({0, stages - 1}) if trusted_ends and stages else frozenset()
        self.slots = SlotTable(self.hosts_of, coordinator, ends) if elastic else None
        self.stages = stages

    def admission_refusal(self, peer: Identity) -> str | None:
        """Why ``peer`` (what its certificate of the run's CA says) may not talk to the control
        service (None: it may; a newcomer is admitted to claim from now on)."""
        if peer.role == "host":
            return None if peer.name in self.hosts else f"{peer} is not a host of this run's placement"
        if self.slots is None:
            return f"{peer} is no host of this run's placement, and only an elastic run admits newcomers"
        if peer.name in self.hosts:
            return f"{peer} bears the name of a host of the placement"
        self.slots.admit(peer.name)
        return None

    def participant(self, who: str) -> bool:
        """Whether ``who`` is a host of the run or an admitted newcomer."""
        return who in self.hosts or (self.slots is not None and who in self.slots.newcomers)

    def host_of(self, process: str) -> str | None:
        """The host that runs ``process`` now: a slot's holder in an elastic run, else the placement's."""
        if self.slots is not None and process in self.slots:
            return self.slots.host(process)
        return self.hosts_of.get(process)

    def host_of_rank(self, rank: int) -> str | None:
        name = self.rank_name.get(rank)
        return None if name is None else self.host_of(name)

    @staticmethod
    def write_once_refusal(key: str, expected: bytes) -> str | None:
        """Why a compare-and-set expecting ``expected`` may not move ``key``: a decision, a claim or a
        record's claimant is fixed by the first write (None: it may)."""
        worker = WORKERS.match(key)
        if expected and worker and WRITE_ONCE.match(worker["rest"]):
            return f"{key!r} is decided once: a compare-and-set must expect it empty"
        return None

    @staticmethod
    def drain_refusal(key: str, expected: bytes, desired: bytes) -> str | None:
        """Why a compare-and-set of the graceful stop's key from ``expected`` to ``desired`` may not
        be made (None: it may, or ``key`` is another). Any host may write the key, and every process
        parses it at every step's end: a value of another form would crash them all, a claimed step
        moved back or a stop before a step already claimed (which some process may have started)
        would have processes stop at different steps, and a stop is final."""
        worker = WORKERS.match(key)
        if not worker or worker["rest"] != "drain":
            return None
        new = DRAIN.match(desired.decode("ascii", errors="replace"))
        old = DRAIN.match(expected.decode("ascii", errors="replace")) if expected else None
        if new is None or (expected and old is None):
            return (f"{key!r} holds 'f:<step>' or 's:<step>:<signal>', not "
                    f"{expected[:40]!r} -> {desired[:40]!r}")
        if old is None:
            return None
        if old["stop"] is not None and desired != expected:
            return f"{key!r} holds a stop ({expected.decode()!r}), which is final"
        if int(new["claimed"] or new["stop"]) < int(old["claimed"] or old["stop"]):
            return (f"{key!r}: the claimed step may not go back "
                    f"({expected.decode()!r} -> {desired.decode()!r})")
        return None

    def claim_refusal(self, who: str, key: str, desired: bytes,
                      has: Callable[[list[str]], bool]) -> str | None:
        """Why ``who``'s compare-and-set of ``key`` to ``desired`` is no valid slot claim (None: it
        is, or ``key`` is no claim)."""
        claim = self._claim_of(key)
        if claim is None:
            return None
        return self.slots.claim_refusal(who, claim[0], claim[1], desired, has)

    def claimed(self, who: str, key: str, desired: bytes) -> dict[str, str]:
        """``who``'s claim of ``key`` with ``desired`` went through: the slot moves to it; returns
        the keys to publish and their values (none: ``key`` is no claim)."""
        claim = self._claim_of(key)
        if claim is None:
            return {}
        slot, generation = claim
        return self.slots.take(who, slot, generation, desired)

    def _claim_of(self, key: str) -> tuple[str, int] | None:
        worker = WORKERS.match(key)
        claim = CLAIM.match(worker["rest"]) if worker and self.slots is not None else None
        return (claim["worker"], int(claim["gen"])) if claim else None

    def refusal(self, who: str, op: str, key: str, amount: int = 0) -> str | None:
        """Why host (or newcomer) ``who`` may not do ``op`` on ``key`` (None: it may)."""
        if not self.participant(who):
            return f"{who} is not a host of this run"
        family, match = self._family(key)
        if family is None:
            return f"{key!r} is no key of a meshlearn run"
        if op in READS:
            return None
        if op not in WRITES or not family.may(self, who, op, match, amount):
            return f"host {who} may not {op} {key!r}"
        return None

    def speaker_refusal(self, who: str, key: str, value: bytes) -> str | None:
        """Why host ``who`` may not store ``value`` as the run's abort: it speaks for a process of
        another host (None: it may, or ``key`` is no abort)."""
        match = WORKERS.match(key)
        if not value or not match or match["rest"] != ABORT:
            return None
        text = value.decode(errors="replace")
        for speaker in SPEAKERS.finditer(text):
            name = speaker["name"] or speaker["by"]
            owner = self.host_of(name)
            if owner is not None and owner != who:
                return (f"host {who} may not report for {name}, which {owner} runs: an abort speaks only "
                        "for its writer's own processes")
        return None

    def entry_refusal(self, who: str, key: str, value: bytes) -> str | None:
        """Why ``value`` may not be stored as host ``who``'s checkpoint shard entry ``key`` (None: it
        may, or ``key`` is none): every process checks an agreement against these entries and an
        elastic run's launchers trust the ``host`` they name, so each is its writer's own word on
        its own file — ``{"host": <writer>, "size": <int ≥ 0>, "sha256": <64 lowercase hex>}`` (no
        ``host`` in a fixed run), at most ``MAX_ENTRY`` bytes."""
        worker = WORKERS.match(key)
        if not worker or not SHARD_ENTRY.match(worker["rest"]):
            return None
        fields = ('{"host": "' + who + '", ' if self.slots is not None else "{") + '"size", "sha256"}'
        if len(value) <= MAX_ENTRY and _entry_ok(value, who if self.slots is not None else None):
            return None
        return (f"{key!r} takes {fields} of at most {MAX_ENTRY} bytes (size an integer ≥ 0, sha256 64 "
                f"lowercase hex digits), not {value[:80]!r}")

    def attributed(self, who: str, key: str, value: bytes) -> bytes:
        """The value stored for ``who``'s write: an abort becomes ``who``'s report (whatever it says
        about others is its claim, never the run's finding)."""
        match = WORKERS.match(key)
        if value and match and match["rest"] == ABORT:
            return f"reported by host {who}: ".encode() + value
        return value

    @staticmethod
    def _family(key: str) -> tuple[Family | None, re.Match | None]:
        worker = WORKERS.match(key)
        if worker:
            rest, families = worker["rest"], WORKER_FAMILIES
        elif key.startswith(LAUNCHERS):
            rest, families = key[len(LAUNCHERS):], LAUNCHER_FAMILIES
        else:
            return None, None
        for family in families:
            match = family.pattern.match(rest)
            if match:
                return family, match
        return None, None
