"""Which keys differ between two config dicts (as ``to_dict`` writes them, or TOML reads them).

Below the trainer and the runtimes alike: a resume names the keys it changed
(``train/provenance.py``), and a cluster host is refused on the first key its config differs from
the coordinator's in (``cluster/shared.py``).
"""

from __future__ import annotations

from typing import Any


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as ``{"section.key": value}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]]:
    """``{key: [old, new]}`` for every key whose value differs between two config dicts."""
    a, b = flatten(old), flatten(new)
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
