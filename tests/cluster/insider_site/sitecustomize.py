"""Given to one host's launcher on its PYTHONPATH, this makes every Python process of that host (the
launcher, its forkserver, the workers forked from it) load ``insider.py``'s patches, which act only
in the process whose RANK is the insider's: how a host runs one malicious worker under meshlearn's
own launcher (``test_cluster_insider.py``). Its pipeline senders lie too (``pipeline_insider.py``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import insider  # noqa: E402, F401 — its patches are the point
import pipeline_insider  # noqa: E402

pipeline_insider.install()
