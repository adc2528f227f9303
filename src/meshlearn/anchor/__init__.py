"""The anchor circuit of mesh adaptation (method note ``mesh_adaptation.md``): Z anchor replicas
that run unmasked forward/backward passes on weights K steps old, off the fast circuit's critical
path, and send the clean gradients of the targeted matrices to the fast replicas' spectral
correction (``meshlearn.optim.spectral``). ``settings`` (the config, free of torch), ``actor``
(one anchor stage as a sans-IO actor, and the fast side's rule, for every runtime), ``circuit``
(the simulator's host of the actors: their virtual time), ``plugin`` (hand-offs and arrivals at
step ends). See
docs/adaptation.md."""
