"""The entry points, above every runtime: they compose a run and nothing imports them.

- ``cli``      the ``meshlearn`` command
- ``worker``   one process of a dist run (what torchrun runs: ``meshlearn worker``); picks the
  role (worker, SENTINEL verifier, anchor stage) and, for ``elastic.enabled``, the elastic layer
- ``launch``   ``meshlearn train --backend dist``: starts the local processes and watches them
- ``plugins``  the built-in trainer plugins, registered by the entry points before a Trainer is built
"""
