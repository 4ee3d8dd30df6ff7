"""Generation on top of an engine: sampling values and the sampler, the generation loop, and
continuous batching (several sessions in one sharded step).

May import: runtime, model, weights, errors. Never serving or cli."""
