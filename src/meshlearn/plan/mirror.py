"""One replica row for D: the cost-only simulator over a mesh whose replicas are mirror images.

In cost-only mode the D replicas of a mesh are identical whenever their links are: every worker
(r, s) runs the same plan on the same microbatch sizes, sends messages of the same sizes over
links of the same profile, and its DP strategy's rounds start, complete and miss their deadlines
at the same virtual times as (0, s)'s. Nothing but the links could tell them apart (no values
exist), so replica 0's row, simulated alone, is the whole mesh's timing, at 1/D of the events:

- a DP message (0, s) → (r, s) goes over its own link, as in the full mesh, and what (0, s)
  receives from (r, s) is its mirror image: by the symmetry that swaps replicas 0 and r, the part
  r sends 0 leaves when 0's leaves for r and arrives over an identical link when that one arrives;
- the built-in all-reduce is the SimDriver's own ring over all D replicas of the stage, every
  replica ready when (0, s) is;
- bytes are D × replica 0's outgoing links' (the others send the same); busy shares and the idle
  fraction are replica 0's (the others' are the same).

It is exact only for symmetric links: ``mirrors(cfg)`` says when (no per-link overrides, no
jitter or loss, whose draws differ per link). ``tests/plan/test_mirror.py`` checks it against the
full simulation on every method row and shows a mesh with one slow replica breaks it.
"""

from __future__ import annotations

from meshlearn.config import RunConfig
from meshlearn.mesh.messages import Message
from meshlearn.mesh.network import Network
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.plan.collectives import SizeCollectives


def mirrors(cfg: RunConfig) -> bool:
    """Whether ``cfg``'s replicas are mirror images in cost-only mode: D > 1 and every link alike
    per axis (no per-link overrides; no jitter or loss, drawn per link), each with a queue of its
    own: with ``links.access = "uplink"`` a worker's DP sends queue one behind another in its
    strategy's order of peers, and the mirror argument (r's part for 0 leaves when 0's part for r
    does) would need that order to be symmetric, which nothing checks: such meshes are simulated
    whole. So is a mesh with an anchor circuit (``anchor.z > 0``): its shares go to every fast
    worker, each judged by its own clock."""
    link = cfg.link
    return (cfg.mesh.replicas > 1 and not cfg.links.overrides.strip()
            and link.jitter_ms == 0 and link.loss_rate == 0 and cfg.links.access == "off"
            and cfg.anchor.z == 0)


class MirrorCollectives(SizeCollectives):
    """The cost-only DP axis of replica 0's row of ``full`` (the SimDriver then simulates
    ``MeshShape(1, P)``; the row's workers are built for the whole mesh: their DP strategies know
    all D replicas)."""

    def __init__(self, full: MeshShape):
        self.full = full

    def stage_ring(self, replicas: list[WorkerId]) -> list[WorkerId]:
        """Every replica of the stage, ready when (0, s) is."""
        (wid,) = replicas
        return self.full.stage_replicas(wid.stage)

    def arriving(self, message: Message) -> Message:
        """What (0, s) receives from (r, s) is the mirror image of what it sent r."""
        if message.dst.replica == 0:
            return message
        return Message("dp", message.step, message.microbatch, message.dst, message.src,  # r's part for 0
                       message.payload, message.skip, message.version)

    def bytes_on_axis(self, network: Network, axis: str) -> int:
        """The whole mesh's bytes on ``axis``: D × what replica 0's links sent."""
        return self.full.replicas * sum(link.bytes_sent for link in network.links.values()
                                        if link.axis == axis and link.src.replica == 0)


__all__ = ["MirrorCollectives", "mirrors"]
