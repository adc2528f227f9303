"""Multi-machine runs: a placement in the config (``[cluster]``), one launcher per machine, and run
folders that need no shared disk (docs/cluster.md)."""
