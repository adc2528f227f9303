"""``data.replica_corpus``'s syntax, apart from the loader: the config validates it without
importing the corpus readers (which import the config)."""

from __future__ import annotations

from pathlib import Path

ALLOWED = "comma-separated R:PATH, R a replica index in [0, mesh.replicas) named once, PATH an existing " \
          "text file, folder or .bin token file"


def parse_replica_corpus(spec: str) -> dict[int, str]:
    """``"1:a.txt,3:b.bin"`` → {1: "a.txt", 3: "b.bin"}; ValueError (the caller names the field)."""
    out: dict[int, str] = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        replica, sep, path = item.partition(":")
        if not sep or not replica.strip().isdigit() or not path.strip() or int(replica) in out:
            raise ValueError(item)
        out[int(replica)] = path.strip()
    return out


def replica_corpus_problem(spec: str, replicas: int) -> str:
    """Why ``spec`` is not a valid ``data.replica_corpus`` for ``replicas`` replicas ("" if it is)."""
    try:
        parsed = parse_replica_corpus(spec)
    except ValueError as err:
        return f"{ALLOWED} (bad item {str(err)!r})"
    for replica, path in parsed.items():
        if replica >= replicas:
            return f"{ALLOWED} (replica {replica} of {replicas})"
        if not Path(path).exists():
            return f"{ALLOWED} ({path} does not exist)"
    return ""
