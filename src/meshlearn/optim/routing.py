"""Route parameters to Muon-style matrix updates or to AdamW.

Why: Muon (and NuMuon) is steepest descent under the spectral norm, which is the right geometry
for *hidden* weight matrices that map one activation space to another (q, k, v, o, gate, up,
down). It is the wrong geometry for

* the token embedding, whose rows are looked up independently (a row only gets gradient when its
  token appears, so orthogonalizing the whole table couples unrelated tokens),
* the LM head, whose rows are per-token logit directions (the Muon authors and Moonlight keep it
  on AdamW; Muon there measurably hurts),
* every non-2-D parameter (norm gains, biases, scalars), which has no matrix structure at all —
  ``torch.optim.Muon`` raises on them.

Embeddings and the head are 2-D, so they can only be recognised by name. Pass *named* parameters
(a module or ``module.named_parameters()``) to get that; with plain tensors only the shape rule
applies and an embedding would be treated as a hidden matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import Tensor, nn

NamedParam = tuple[str | None, Tensor]


def is_embedding_or_head(name: str) -> bool:
    """Default name rule for 2-D parameters that belong on AdamW: names containing ``emb``
    (``tok_emb.weight``, ``embed_tokens.weight``) or ending with ``head.weight`` (``head.weight``,
    ``lm_head.weight``). GPT-2 style ``wte``/``wpe`` do *not* match: pass your own predicate."""
    return "emb" in name or name.endswith("head.weight")


@dataclass
class ParamSplit:
    """Result of :func:`split_params`: ``(name, param)`` pairs, in input order. ``name`` is
    ``None`` for parameters given without a name."""

    matrix: list[NamedParam] = field(default_factory=list)
    adamw: list[NamedParam] = field(default_factory=list)


def _named(params: nn.Module | Iterable[Tensor] | Iterable[tuple[str, Tensor]]) -> list[NamedParam]:
    if isinstance(params, nn.Module):
        return list(params.named_parameters())
    if isinstance(params, Tensor):
        raise TypeError("split_params: pass an iterable of parameters, not a single tensor")
    out: list[NamedParam] = []
    for item in params:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Tensor):
            out.append((str(item[0]), item[1]))
        elif isinstance(item, Tensor):
            out.append((None, item))
        else:
            raise TypeError(
                "split_params: expected a module, tensors, or (name, tensor) pairs, "
                f"got an item of type {type(item).__name__}"
            )
    return out


def split_params(
    params: nn.Module | Iterable[Tensor] | Iterable[tuple[str, Tensor]],
    is_adamw_name: Callable[[str], bool] = is_embedding_or_head,
) -> ParamSplit:
    """Split parameters into a ``matrix`` group (2-D hidden weights, for Muon/NuMuon) and an
    ``adamw`` group (everything else).

    A parameter goes to ``adamw`` if it is not 2-D, or if it has a name and
    ``is_adamw_name(name)`` is true. Frozen parameters are kept (as in ``torch.optim``): they are
    skipped at step time while their ``grad`` is ``None``.

    Args:
        params: an ``nn.Module``, its ``named_parameters()``, or plain tensors.
        is_adamw_name: name predicate for 2-D parameters that must still use AdamW. The default,
            :func:`is_embedding_or_head`, matches ``*emb*`` and ``*head.weight``; replace it if
            your model names its embedding or head differently (e.g. GPT-2's ``wpe``).
    """
    split = ParamSplit()
    for name, p in _named(params):
        to_adamw = p.ndim != 2 or (name is not None and is_adamw_name(name))
        (split.adamw if to_adamw else split.matrix).append((name, p))
    return split
