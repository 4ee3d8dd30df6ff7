"""`fusion serve`'s server: the transport-free gateway, the engine's scheduler thread, the
OpenAI-compatible routes on FastAPI, their request and response models, the HTTP limits and the
admin endpoints.

May import: generation, runtime, structural, masked, weights, comm, errors, and cli.options (an engine
assembled from flags). Nothing imports serving but cli."""
