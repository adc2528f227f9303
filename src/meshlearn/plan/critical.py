"""What a simulated time is made of: virtual seconds that carry their own critical path.

Every time on the simulator's clock is built from a few costs — a forward's or backward's
FLOPs ÷ rate, a message's bytes ÷ bandwidth on a PP or DP link, a link's latency, an optimizer
step's bytes ÷ memory bandwidth — by ``+`` (one thing after another) and ``max`` (waiting for
the later of two). ``Seconds`` is a float that also carries how much of its value each kind of
cost contributed along the chain of ``+`` and ``max`` that produced it: ``max`` returns one of
its arguments, whole, so a time's parts are those of the path that bound it. The difference of
two step ends is then the critical path of the window between them, split by resource — from
the simulation itself, its own code, with nothing doubled and nothing run again.

Because every time is a sum of costs along one path, the parts add up to the time (Euler's
rule for a function of degree 1 in its costs); whatever does not (a constant such as an
explicit ``dp.deadline_s``) is ``other``. Scaling one resource by 2 shortens that path by
half its share, so ``1 / (1 − share / 2)`` bounds the gain of doubling it: exact while the same
path stays critical, less where a second path is nearly as long. Ties (two causes at the same
instant) go to the first argument of ``max``: either path is critical then.

``sensitive_network`` and ``SensitiveCompute`` put such seconds into a cost-only run
(``CostRun(..., critical_path=True)``); the simulator's event loop runs unchanged over them.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from meshlearn.mesh.compute import ComputeModel, StageShape
from meshlearn.mesh.network import LinkProfile, Network

PARTS = ("compute", "PP link", "DP link", "latency", "update")  # ``update``: memory-bound optimizer steps
_INDEX = {name: i for i, name in enumerate(PARTS)}
_ZERO = (0.0,) * len(PARTS)
_new = float.__new__


class Seconds(float):
    """Virtual seconds with their parts per resource (``g``, in the order of ``PARTS``)."""

    __slots__ = ("g",)

    def __new__(cls, value: float, g: tuple[float, ...]):
        x = float.__new__(cls, value)
        x.g = g
        return x

    @staticmethod
    @functools.lru_cache(maxsize=4096)  # a simulation asks for the same few costs over and over
    def of(value: float, part: str) -> Seconds:
        """``value`` seconds of one resource's cost (shared: a Seconds is never changed in place)."""
        g = list(_ZERO)
        g[_INDEX[part]] = value
        return Seconds(value, tuple(g))

    # ``+`` and ``-`` run a few times per simulated event: they build the result in place
    # (``_new``) rather than through ``Seconds(...)``, a Python call fewer each.
    def __add__(self, other):
        x = _new(Seconds, float.__add__(self, other))
        if type(other) is Seconds:
            a, b = self.g, other.g
            x.g = (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3], a[4] + b[4])
        else:
            x.g = self.g  # a constant: no resource's
        return x

    __radd__ = __add__

    def __sub__(self, other):
        x = _new(Seconds, float.__sub__(self, other))
        if type(other) is Seconds:
            a, b = self.g, other.g
            x.g = (a[0] - b[0], a[1] - b[1], a[2] - b[2], a[3] - b[3], a[4] - b[4])
        else:
            x.g = self.g
        return x

    def __rsub__(self, other):
        return Seconds(float.__rsub__(self, other), tuple(-x for x in self.g))

    def __mul__(self, k):
        if type(k) is Seconds:  # seconds × seconds is no time: a plain number
            return float.__mul__(self, k)
        return Seconds(float.__mul__(self, k), tuple(k * x for x in self.g))

    __rmul__ = __mul__

    def __truediv__(self, k):
        if type(k) is Seconds:  # a ratio of times: a plain number
            return float.__truediv__(self, k)
        return Seconds(float.__truediv__(self, k), tuple(x / k for x in self.g))

    def __reduce__(self):
        return Seconds, (float(self), self.g)

    def shares(self) -> dict[str, float]:
        """Each resource's share of this duration, and ``other``: what no resource accounts for."""
        total = float(self)
        if total <= 0:
            return {**dict.fromkeys(PARTS, 0.0), "other": 0.0}
        out = {name: x / total for name, x in zip(PARTS, self.g, strict=True)}
        out["other"] = 1.0 - sum(out.values())
        return out


@dataclass(frozen=True)
class SensitiveProfile(LinkProfile):
    """A link profile whose serialization counts as its axis's bandwidth and whose delay as latency."""

    axis: str = "pp"
    # Seconds per message size, asked at every transfer (a profile is never changed: kept; not an
    # init field, so ``dataclasses.replace`` with another bandwidth starts a cache of its own).
    serialization: dict[int, Seconds] = field(default_factory=dict, init=False, compare=False, repr=False)

    def serialization_s(self, nbytes: int) -> float:
        seconds = self.serialization.get(nbytes)
        if seconds is None:
            part = "PP link" if self.axis == "pp" else "DP link"
            seconds = self.serialization[nbytes] = Seconds.of(super().serialization_s(nbytes), part)
        return seconds

    @functools.cached_property
    def latency_s(self) -> float:
        return Seconds.of(super().latency_s, "latency")


def _sensitive(profile: LinkProfile, axis: str) -> SensitiveProfile:
    fields = {f.name: getattr(profile, f.name) for f in dataclasses.fields(LinkProfile)}
    return SensitiveProfile(**fields, axis=axis)


def sensitive_network(network: Network) -> Network:
    """``network`` (before any link exists) with every profile's times carrying their resource."""
    assert not network.links, "profiles are swapped before the first link is built"
    network.default = _sensitive(network.default, "pp")  # only its latency is used (the clip barrier)
    network.axes = {axis: _sensitive(p, axis) for axis, p in network.axes.items()}
    network.overrides = {key: _sensitive(p, "pp" if key[0].replica == key[1].replica else "dp")
                         for key, p in network.overrides.items()}
    return network


class SensitiveCompute(ComputeModel):
    """The device model whose forward/backward seconds count as compute, updates as ``update``."""

    def compute_s(self, stage: StageShape, kind: str, batch: int, measured_s: float) -> float:
        return Seconds.of(super().compute_s(stage, kind, batch, measured_s), "compute")

    def update_s(self, n_params: int, measured_s: float) -> float:
        return Seconds.of(super().update_s(n_params, measured_s), "update")


__all__ = ["PARTS", "Seconds", "SensitiveCompute", "SensitiveProfile", "sensitive_network"]
