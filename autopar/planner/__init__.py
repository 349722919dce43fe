"""Between a traced graph and a ``Plan``: the problem builder (strategies and conversion costs per
node, liveness, recompute segments), activation-recompute orchestration, the hand-written
baseline families, and the assembly of the public ``Plan`` record."""
