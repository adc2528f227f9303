"""Every process group of a dist run, created in one order in every process.

Creating a group is collective over the whole world (members or not), so workers and the verifier
call ``build_groups`` alike and each keeps its own. Without verification the world is the D × P
workers; with ``verify.name = "sentinel"`` one more rank, the verifier (``verifier_rank``), relays
every pipeline message, and the workers' own collectives (the per-step gather, barriers, the
validation loss) get a group of the workers alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from meshlearn.mesh.topology import MeshShape, WorkerId

Link = tuple[WorkerId, WorkerId]


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


def build_groups(cfg, mesh: MeshShape, rank: int, dp_groups: bool = True) -> Groups:
    """The run's groups, in the same order everywhere; ``rank``'s are returned. ``dp_groups``: one
    per stage for the all-reduce (False: elastic runs, where torchft's quorum owns that axis)."""
    verifier = verifier_rank(cfg, mesh)
    me = mesh.worker(rank) if rank < mesh.world_size else None
    groups = Groups()
    for s in range(mesh.stages if dp_groups else 0):
        group = dist.new_group([mesh.rank(w) for w in mesh.stage_replicas(s)])
        if me is not None and me.stage == s:
            groups.dp = group
    if verifier is not None or anchors(cfg):
        groups.workers = dist.new_group(list(range(mesh.world_size)))
    for r in range(mesh.replicas):
        for s in range(mesh.stages - 1):
            a, b = WorkerId(r, s), WorkerId(r, s + 1)
            for src, dst in ((a, b), (b, a)):  # one group per direction (and per hop)
                if verifier is None:
                    group = dist.new_group([mesh.rank(a), mesh.rank(b)])
                    if me in (a, b):
                        groups.links[(src, dst)] = group
                    continue
                into = dist.new_group([mesh.rank(src), verifier])
                out = dist.new_group([verifier, mesh.rank(dst)])
                if me is None:
                    groups.links[(src, dst)] = (into, out)
                elif me == src:
                    groups.links[(src, dst)] = into
                elif me == dst:
                    groups.links[(src, dst)] = out
    if cfg.dp.name != "allreduce" and mesh.replicas > 1:
        # A message-based DP strategy: one group per directed pair of a stage's replicas, as the
        # pipeline links (its rounds travel point to point in the background, never as collectives).
        for s in range(mesh.stages):
            for a in range(mesh.replicas):
                for b in range(mesh.replicas):
                    if a != b:
                        src, dst = WorkerId(a, s), WorkerId(b, s)
                        group = dist.new_group([mesh.rank(src), mesh.rank(dst)])
                        if me in (src, dst):
                            groups.links[(src, dst)] = group
    for src, dst in anchor_link_list(mesh, anchors(cfg)):
        group = dist.new_group([rank_of(mesh, src), rank_of(mesh, dst)])
        if rank in (rank_of(mesh, src), rank_of(mesh, dst)):
            groups.anchor_links[(src, dst)] = group
    return groups


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
