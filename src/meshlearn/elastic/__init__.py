"""Elastic membership on torchft: stage replicas leave mid-run while the others keep training.

Like ``meshlearn.distributed``, this ``__init__`` imports neither torch.distributed nor torchft,
so the config tree can use ``meshlearn.elastic.settings``.

- ``settings``   ElasticConfig (``elastic.*``) and the torchft timeouts derived from the links
- ``listeners``  which addresses a process listens on (/proc), to prove nothing is on 0.0.0.0
- ``binding``    torchft's lighthouse, manager and quorum store, each bound to ``elastic.host``
- ``quorum``     one torchft Manager per stage replica: the quorum, the DP mean, the commit vote
- ``control_quorum``  the same interface without torchft (``elastic.membership = "control"``): the
                 quorum a record on the run's store, reused until a change; sums over framed streams
"""
