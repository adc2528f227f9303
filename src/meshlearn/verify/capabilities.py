"""What the trust layer asks of a runtime beyond the ``Driver`` (mesh/driver.py): optional
capabilities, each a small Protocol a runtime implements by having its members, tested with
``isinstance``. They name SENTINEL's own types, so they live beside the method, not in the
driver contract.

- ``RemoteVerdicts``: SENTINEL runs in a verifier process of its own (the distributed runtime);
  the workers read its verdicts, exchange the attackers' ground truth and copy a ban's donor.
- ``Evictor``: a ban is an eviction (the elastic runtime): the banned worker's row leaves.
- ``BanNotices``: the verifier process learns of bans decided outside it (DP evictions), so one
  budget holds there too (the distributed runtime).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from meshlearn.mesh.topology import WorkerId
from meshlearn.verify.ledger import Ban
from meshlearn.verify.verdicts import RemoteSentinel


@runtime_checkable
class RemoteVerdicts(Protocol):
    remote_sentinel: RemoteSentinel | None
    """The verifier process's published verdicts (None: this run has no verifier process)."""

    def exchange_truth(self, step: int, local: dict[WorkerId, set], attackers: list[WorkerId]
                       ) -> dict[WorkerId, set]:
        """Publish this process's attackers' ground truth of ``step``; the records' writer gets
        every attacker's."""
        ...

    def copy_worker_state(self, donor: WorkerId, target: WorkerId) -> None:
        """A banned worker's replacement loads ``donor``'s state (a collective of the stage)."""
        ...


@runtime_checkable
class BanNotices(Protocol):
    def post_bans(self, step: int, bans: list[dict]) -> None:
        """Tell the verifier process (if any) of the bans carried out at ``step``'s end that it did
        not decide (``ban`` records); called every step by every process, posted by one."""
        ...


@runtime_checkable
class Evictor(Protocol):
    def evict(self, ban: Ban) -> None:
        """Carry out ``ban`` as an eviction: the banned worker's row leaves, nobody takes the slot."""
        ...
