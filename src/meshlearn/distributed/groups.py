"""Every process group of a dist run, created in one order in every process, and the streams
that replace them where links are not trusted.

Creating a group is collective over the whole world (members or not), so workers and the verifier
call ``build_groups`` alike and each keeps its own. Without verification the world is the D × P
workers; with ``verify.name = "sentinel"`` one more rank, the verifier (``verifier_rank``), relays
every pipeline message, and the workers' own collectives (the per-step gather, barriers, the
validation loss) get a group of the workers alone. With ``dist.trusted_links`` false no group is
created at all: the point-to-point links are streams, and the workers' collectives run over a
stream per ordered pair of workers (``collective_hops``, ``collectives.py``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from meshlearn.distributed.collectives import FramedCollectives
from meshlearn.distributed.health import Health, store_client
from meshlearn.distributed.settings import links_of, links_trusted
from meshlearn.distributed.streams import Hop, Link, PlainConnector, StreamConnector, listen_address
from meshlearn.dp.robust import Robust
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.net.counters import Counters


def verifier_rank(cfg, mesh: MeshShape) -> int | None:
    """The rank of the SENTINEL verifier process (after the workers), or None without one."""
    return mesh.world_size if cfg.verify.name == "sentinel" else None


def anchors(cfg) -> int:
    """Anchor replicas that run as processes of their own (``anchor.z`` of a dist run)."""
    return cfg.anchor.z if cfg.backend == "dist" else 0


def anchor_id(mesh: MeshShape, z: int, stage: int) -> WorkerId:
    """Anchor replica z's stage, numbered after the D fast replicas (the simulator's numbering)."""
    return WorkerId(mesh.replicas + z, stage)


def rank_of(mesh: MeshShape, wid: WorkerId) -> int:
    """A worker's rank, or an anchor stage's: the Z × P ranks after the workers, z-major."""
    if wid.replica < mesh.replicas:
        return mesh.rank(wid)
    return mesh.world_size + (wid.replica - mesh.replicas) * mesh.stages + wid.stage


def world_size(cfg, mesh: MeshShape) -> int:
    """Processes of the run: the workers, plus the verifier when verifying, plus Z × P anchor
    stages with an anchor circuit (the two are not combined: anchor/settings.py)."""
    return mesh.world_size + (verifier_rank(cfg, mesh) is not None) + anchors(cfg) * mesh.stages


@dataclass(frozen=True)
class PairGroup:
    """A two-rank gloo group of its own over a store, outside the world group (an elastic row's
    pipeline link: its processes may have started long after the world group was formed).
    ``peer``: the other end's rank in this group (0 or 1); the transport addresses it so."""

    pg: dist.ProcessGroup
    peer: int


def pair_group(store: dist.Store, rank: int, interface: str, timeout_s: float) -> PairGroup:
    """Rendezvous with the other end over ``store`` (a prefix unique to the link); blocks until it
    is there or ``timeout_s`` passes. ``interface``: the one gloo may use (elastic.host's)."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(interface=interface)]
    options._timeout = timedelta(seconds=timeout_s)
    return PairGroup(dist.ProcessGroupGloo(store, rank, 2, options), 1 - rank)


@dataclass
class Groups:
    """This process's groups. ``links``: per logical link (src, dst), the group it sends or receives
    on (a worker), or the (receive, send) pair the verifier relays it on."""

    dp: object | None = None  # the replicas of this worker's stage (None for the verifier)
    workers: object | None = None  # the workers' collectives; None: the default group (no verifier)
    links: dict[Link, object] = field(default_factory=dict)
    anchor_links: dict[Link, object] = field(default_factory=dict)  # the anchor circuit's own
    framed: FramedCollectives | None = None  # untrusted links: the workers' collectives, no group
    counters: Counters | None = None  # where this process counts what it refused (its streams' connector's)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def build_groups(cfg, mesh: MeshShape, rank: int, dp_groups: bool = True,
                 connector: StreamConnector | None = None) -> Groups:
    """The run's groups, in the same order everywhere; ``rank``'s are returned. ``dp_groups``: one
    per stage for the all-reduce (False: elastic runs, where torchft's quorum owns that axis).
    The point-to-point links are groups too, or with ``dist.links`` resolving to tcp, streams
    of our own (``streams.py``), connected here: every process of the run comes through here.
    ``connector``: who makes those streams (the entry point's; None: ``PlainConnector`` over the
    rendezvous store)."""
    verifier = verifier_rank(cfg, mesh)
    me = mesh.worker(rank) if rank < mesh.world_size else None
    trusted = links_trusted(cfg)
    groups = Groups()
    for s in range(mesh.stages if dp_groups and trusted else 0):
        group = dist.new_group([mesh.rank(w) for w in mesh.stage_replicas(s)])
        if me is not None and me.stage == s:
            groups.dp = group
    if trusted and (verifier is not None or anchors(cfg)):
        groups.workers = dist.new_group(list(range(mesh.world_size)))
    links, anchor_links = link_hops(cfg, mesh), anchor_hops(mesh, anchors(cfg))
    hops = links + anchor_links
    if links_of(cfg) == "tcp" or not trusted:
        if connector is None:
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            connector = PlainConnector(store_client(host, port, cfg.dist.init_timeout_s),
                                       listen_address(host, port))
        pairs = collective_hops(mesh)
        channels = {"links": hops} | ({"collectives": pairs} if not trusted else {})
        connected = connector.connect(rank, channels, cfg.dist.init_timeout_s)
        groups.counters = connector.counters
        ends = connected["links"]
        if not trusted:
            mine = connected["collectives"]
            groups.framed = FramedCollectives(
                rank, {b: mine[i] for i, (_, a, b) in enumerate(pairs) if a == rank},
                {a: mine[i] for i, (_, a, b) in enumerate(pairs) if b == rank},
                connector.counters, log=_stderr) if me is not None else None
    else:  # one group per hop, created by every rank
        ends = {i: dist.new_group([a, b]) for i, (_, a, b) in enumerate(hops)}
    groups.links = ends_of(links, ends, rank)
    groups.anchor_links = ends_of(anchor_links, {i - len(links): end for i, end in ends.items()}, rank)
    return groups


def collective_hops(mesh: MeshShape) -> list[Hop]:
    """The framed collectives' streams: one per ordered pair of workers (a stage's replicas sum
    their gradients over them; every worker gathers every other's report row)."""
    return [((a, b), mesh.rank(a), mesh.rank(b)) for a in mesh.workers() for b in mesh.workers() if a != b]


class GroupCollectives:
    """A worker's collectives over process groups (``dist.trusted_links`` true): the stage's ``dp``
    group and the workers' group (None: the default group), each wait bounded by ``deadline_s``
    through ``health``. The driver's interface, the same as ``collectives.RunCollectives``'s."""

    framed = False

    def __init__(self, dp_group, workers_group, health: Health, world: int, device: torch.device,
                 deadline_s: float):
        self.dp_group, self.workers_group = dp_group, workers_group
        self.health, self.world, self.device, self.deadline_s = health, world, device, deadline_s

    def stage_sum(self, flat: torch.Tensor, what: str, release: Mapping[int, float] | None = None
                  ) -> torch.Tensor:
        """Σ over the stage's replicas, in place (a ring: bit for bit the simulator's at D = 2 only)."""
        work = dist.all_reduce(flat, group=self.dp_group, async_op=True)
        self.health.wait_work(work, what, self.deadline_s)
        return flat

    def stage_reduce(self, flat: torch.Tensor, rule: Robust,
                     what: str) -> tuple[torch.Tensor, list[float] | None]:
        """``rule``'s aggregate (``dp.robust``) of the stage's replicas' ``flat`` and each one's
        outlier score: an all-gather over the stage's group, then the simulator's reduce of the
        stacked contributions."""
        parts = [torch.zeros_like(flat) for _ in range(dist.get_world_size(self.dp_group))]
        work = dist.all_gather(parts, flat, group=self.dp_group, async_op=True)
        self.health.wait_work(work, what, self.deadline_s)
        return rule.reduce_scored(torch.stack(parts))

    def gather(self, rows: torch.Tensor, what: str) -> torch.Tensor:
        rows = rows.to(self.device)
        out = [torch.zeros_like(rows) for _ in range(self.world)]
        work = dist.all_gather(out, rows, group=self.workers_group, async_op=True)
        self.health.wait_work(work, what, self.deadline_s)
        return torch.stack(out).cpu()

    def broadcast(self, value: torch.Tensor, src: int, what: str) -> torch.Tensor:
        work = dist.broadcast(value, src=src, group=self.workers_group, async_op=True)
        self.health.wait_work(work, what, self.deadline_s)
        return value

    def broadcast_state(self, blob: torch.Tensor | None, src: int, bound: int, what: str) -> torch.Tensor:
        """``src``'s blob over the stage's group: its size first, then the bytes (``bound``:
        unchecked here; gloo allocates what the size says)."""
        size = torch.tensor([0 if blob is None else blob.numel()], dtype=torch.int64)
        work = dist.broadcast(size, src=src, group=self.dp_group, async_op=True)
        self.health.wait_work(work, f"the size for {what}", self.deadline_s)
        if blob is None:
            blob = torch.empty(int(size.item()), dtype=torch.uint8)
        work = dist.broadcast(blob, src=src, group=self.dp_group, async_op=True)
        self.health.wait_work(work, what, self.deadline_s)
        return blob

    def barrier(self, what: str) -> None:
        work = dist.barrier(group=self.workers_group, async_op=True)
        self.health.wait_work(work, what, self.deadline_s)

    def close(self) -> None:
        pass


def link_hops(cfg, mesh: MeshShape) -> list[Hop]:
    """The run's pipeline and message-based DP links as connections, in one order: per directed
    pipeline link (r, s) → (r, s ± 1), the hop between its workers, or with a verifier the two hops
    through it (src → verifier, verifier → dst); per directed pair of a stage's replicas with a
    message-based DP strategy (its rounds travel point to point in the background, never as
    collectives), the hop between them."""
    verifier = verifier_rank(cfg, mesh)
    hops = []
    for r in range(mesh.replicas):
        for s in range(mesh.stages - 1):
            a, b = WorkerId(r, s), WorkerId(r, s + 1)
            for src, dst in ((a, b), (b, a)):  # one per direction (and per hop)
                if verifier is None:
                    hops.append(((src, dst), mesh.rank(src), mesh.rank(dst)))
                else:
                    hops += [((src, dst), mesh.rank(src), verifier), ((src, dst), verifier, mesh.rank(dst))]
    if cfg.dp.name != "allreduce" and mesh.replicas > 1:
        for s in range(mesh.stages):
            for a in range(mesh.replicas):
                for b in range(mesh.replicas):
                    if a != b:
                        src, dst = WorkerId(a, s), WorkerId(b, s)
                        hops.append(((src, dst), mesh.rank(src), mesh.rank(dst)))
    return hops


def anchor_hops(mesh: MeshShape, z_count: int) -> list[Hop]:
    """The anchor circuit's links (``anchor_link_list``), each a hop between its two ends."""
    return [((src, dst), rank_of(mesh, src), rank_of(mesh, dst))
            for src, dst in anchor_link_list(mesh, z_count)]


def ends_of(hops: list[Hop], ends: dict[int, object], rank: int) -> dict[Link, object]:
    """Per logical link ``rank`` is on, its end (``ends``: by hop index): the one it sends or
    receives on, or for a relay on both hops of the link, the (receive, send) pair."""
    mine: dict[Link, dict[str, object]] = {}
    for i, (link, a, b) in enumerate(hops):
        if rank in (a, b):
            mine.setdefault(link, {})["send" if rank == a else "recv"] = ends[i]
    return {link: (end["recv"], end["send"]) if len(end) == 2 else next(iter(end.values()))
            for link, end in mine.items()}


def anchor_link_list(mesh: MeshShape, z_count: int) -> list[Link]:
    """The anchor circuit's directed links, in one order: per anchor replica z and stage s, the
    snapshot fast (0, s) → anchor (z, s), the anchor pipeline (z, s) ↔ (z, s + 1), and the gradients
    anchor (z, s) → fast (r, s) for every fast replica r."""
    links = []
    for z in range(z_count):
        for s in range(mesh.stages):
            a = anchor_id(mesh, z, s)
            links.append((WorkerId(0, s), a))
            if s + 1 < mesh.stages:
                b = anchor_id(mesh, z, s + 1)
                links += [(a, b), (b, a)]
            links += [(a, WorkerId(r, s)) for r in range(mesh.replicas)]
    return links
