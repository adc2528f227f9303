"""Authenticated networking for runs whose participants are strangers (issue 27).

The bottom layer of the runtime: it imports only the standard library, torch, ``cryptography``
and meshlearn's core basics, never config, train, distributed or elastic, so every runtime can
build on it.

- ``keys``: the run's own certificate authority, one credential per host and per joiner,
  revocation.
- ``tls``: mutual TLS 1.3 with the run's CA as the only trust root; each end learns the other's
  identity; handshakes under a deadline and a cap on half-open ones.
- ``port``: one inbound TCP port per machine; a fixed-size routing preamble names the local
  process a connection is for, whose socket is handed over (no byte proxied).
- ``frames``: bounded frame reading shared by plain and authenticated streams.
- ``links``: an authenticated link: TLS, then a hello whose sending worker must belong to the
  identity in the peer's certificate.
- ``counters``: what was refused and why, for a run's summary.

See docs/security.md for the threat model and what is not wired yet.
"""
