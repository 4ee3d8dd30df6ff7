"""The model, knowing nothing of sharding: its config, the architecture table every consumer reads,
the kernels every layer shares, the decoder layer (written once, over the ops each execution
implements), the dense twin, and transformers as the reference.

May import: errors, weights (to read tensors; weights imports only model.config back). Nothing that
shards or runs a job."""
