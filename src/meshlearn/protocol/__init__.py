"""Unextractable protocol models (arXiv 2605.23464): stage weights that change basis over time
while the model's function does not, so stages collected at different times do not compose.

- ``settings``: the ``[protocol]`` config section and its checks;
- ``transforms``: Haar-orthogonal and low-condition transforms, drawn in fp64;
- ``model``: the protocol model (folded gains, basis matrices, fixed-basis embedding and head);
- ``morph``: folding a transform into both sides of every boundary, on fp64 master copies;
- ``plugin``: morphs every N steps at drain points, transforms sent over the boundary links.

See docs/protocol.md.
"""

from meshlearn.protocol.model import ProtocolDecoder, protocol_model
from meshlearn.protocol.settings import ProtocolConfig, validate_protocol

__all__ = ["ProtocolConfig", "ProtocolDecoder", "protocol_model", "validate_protocol"]
