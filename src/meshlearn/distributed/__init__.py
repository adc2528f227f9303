"""The distributed runtime: one OS process per worker (r, s) over torch.distributed.

Only this package imports torch.distributed, and this ``__init__`` imports none of it, so the
config tree can use ``meshlearn.distributed.settings`` without pulling in the runtime.

- ``settings``  DistConfig (``dist.*`` keys) and the deadlines derived from the link profile
- ``wire``      a Message as two tensors (a length prefix and one byte buffer)
- ``shaping``   paces a sender to its LinkProfile with the simulator's own link arithmetic
- ``health``    heartbeats through the rendezvous store; one abort message naming the worker
- ``groups``    every process group, created in one order by every process
- ``transport`` background senders/receivers over one process group per directed link
- ``driver``    DistDriver: the same Worker objects, driven by real messages
- ``dp_axis``   the driver's DP axis: the stage's all-reduce held to the link model, a
  message-based strategy's rounds in real time
- ``process_rows`` the step report from every process's row, gathered; the summary's link table
- ``worker``    the per-process entry point (what torchrun runs: ``meshlearn worker``)
- ``verifier``  the SENTINEL verifier process (the extra rank with ``verify.name = sentinel``),
  relaying every pipeline message; ``verdict_board`` its verdicts on the rendezvous store
- ``launch``    ``meshlearn train --backend dist``: starts the local processes itself
"""
