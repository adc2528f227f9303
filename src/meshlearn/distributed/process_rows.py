"""ProcessRows: the dist runtime's step report, built from one row per process.

Each process writes its own row of a step (``mesh/report.py``'s ``ProcessRow``: losses, squared
norm, busy time, bytes, staleness, its stage's outlier scores, and the counters of its link
slots), one gather gives every process every row, and the report is the simulator's arithmetic
over them (``mesh_report``), so whichever process writes metrics logs real losses, and no process
reports its own outlier score alone (its stage's rows vote it: ``voted_scores``). A flushing
schedule gathers a step's rows at its update; under ``async`` a worker keeps its rows
(``pending``) until the drain point's gather.
The last step's rows give the summary its link table and idle fraction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshlearn.mesh.network import Network
from meshlearn.mesh.report import ProcessRow, StepReport, idle_fraction, link_table, mesh_report, stats_row
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.worker import StepStats


class ProcessRows:
    """This process's rows and every process's, once gathered. ``slots``: this worker's links in
    row order (to the next stage, to the previous, to the ring's next; None where there is none);
    ``gather``: every process's (steps × n) values → (world, steps, n), a collective."""

    def __init__(self, mesh: MeshShape, network: Network, slots: list[tuple[WorkerId, WorkerId | None]],
                 microbatches: int, gather: Callable[[torch.Tensor], torch.Tensor]):
        self.mesh = mesh
        self.network = network
        self.slots = slots
        self.microbatches = microbatches
        self.gather = gather
        self.last: list[ProcessRow] | None = None  # the last step's, every process's, for the summary
        self.pending: list[ProcessRow] = []  # async: this worker's rows of steps not yet gathered

    def own(self, stats: StepStats, bytes_pp: int, bytes_dp: int, busy_s: float, dp_wait_s: float,
            sq_norm: float | None = None) -> ProcessRow:
        """This process's numbers for one step: losses, squared norm, busy time, bytes, staleness,
        its stage's outlier scores, links."""
        links = []
        for src, dst in self.slots:
            link = self.network.link(src, dst) if dst is not None else None
            links.append((link.bytes_sent, link.busy_s) if link is not None else (0.0, 0.0))
        return stats_row(stats, self.microbatches, sq_norm, busy_s=busy_s, bytes_pp=bytes_pp,
                         bytes_dp=bytes_dp, dp_wait_s=dp_wait_s, links=links)

    def gather_steps(self, rows: list[ProcessRow]) -> list[list[ProcessRow]]:
        """This process's rows of some steps → per step, every process's row (by rank); the last
        step's are kept for the summary."""
        M, slots, D = self.microbatches, len(self.slots), self.mesh.replicas
        gathered = self.gather(torch.stack([row.pack(M, slots, D) for row in rows]))
        per_step = [[ProcessRow.unpack(gathered[rank, i], M, slots, D) for rank in range(gathered.shape[0])]
                    for i in range(gathered.shape[1])]
        self.last = per_step[-1]
        return per_step

    def report(self, step: int, rows: list[ProcessRow]) -> StepReport:
        """One step's report from every process's row (by rank), the simulator's arithmetic."""
        return mesh_report(step, self.mesh, {self.mesh.worker(rank): row for rank, row in enumerate(rows)},
                           None, sum(row.bytes_pp for row in rows), sum(row.bytes_dp for row in rows))

    def usage(self, wall_s: float) -> dict:
        """The summary's ``idle_fraction`` and ``links`` (each link's bytes, busy time and
        utilization over ``wall_s``), from the last step's rows (none yet: no value)."""
        rows = self.last
        if rows is None:
            return {"idle_fraction": None, "links": []}
        links = []
        replicas = self.mesh.replicas
        for rank in range(self.mesh.world_size):
            wid = self.mesh.worker(rank)
            peers = (self.mesh.next_stage(wid), self.mesh.prev_stage(wid),
                     WorkerId((wid.replica + 1) % replicas, wid.stage) if replicas > 1 else None)
            links += [(wid, peer, "pp" if i < 2 else "dp", *rows[rank].links[i])
                      for i, peer in enumerate(peers) if peer is not None]
        return {"idle_fraction": idle_fraction(sum(row.busy_s for row in rows), self.mesh.world_size, wall_s),
                "links": link_table(links, wall_s)}
