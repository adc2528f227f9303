"""The compatibility table (``meshlearn.compat``) for people: ``meshlearn config --compat`` and
docs/compat.md, both written from the table itself, with each row's message as its example config
gets it (so the page shows what a user reads, and cannot drift from the code: a test regenerates
it and compares).
"""

from __future__ import annotations

from pathlib import Path

from meshlearn.compat import TABLE, Refusal
from meshlearn.config import load_config
from meshlearn.errors import ConfigError

DOCS_PAGE = Path("docs") / "compat.md"


def example_message(row: Refusal) -> str:
    """The ConfigError text that ``row.example`` gets from ``load_config``."""
    try:
        load_config(None, list(row.example))
    except ConfigError as err:
        return str(err)
    raise AssertionError(f"the example of the row on {row.key} is accepted: {row.example}")


def format_compat() -> str:
    """One block per refused combination: the settings, then the field named and an example message."""
    lines = []
    for i, row in enumerate(TABLE, 1):
        lines += [f"{i:2d}. {row.settings}",
                  f"    refused as {row.key}; e.g. --set {' --set '.join(row.example)}",
                  f"    → {example_message(row)}"]
    return "\n".join(lines)


def compat_markdown() -> str:
    """docs/compat.md: every refused combination, in the order they are checked."""
    lines = ["# Refused combinations", "",
             "Generated from the table in `src/meshlearn/compat.py` by",
             "`python -m meshlearn.train.config_help` — do not edit by hand (`tests/test_compat.py` fails",
             "when this page is stale). The same list on the command line: `meshlearn config --compat`.", "",
             "A component checks its own keys beside its config; every refusal that reads settings of two",
             "components is a row here, checked in this order once each component's own keys are valid,",
             "before any work starts. The first row that holds names its field in the one-line error;",
             "the message column is what the row's example (`--set` overrides of the defaults) gets.", "",
             f"{len(TABLE)} refused combinations.", "",
             "| # | when all of these hold | error names | example | message |", "|---|---|---|---|---|"]
    for i, row in enumerate(TABLE, 1):
        cells = [str(i), row.settings, f"`{row.key}`", " ".join(f"`{s}`" for s in row.example),
                 example_message(row)]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"
