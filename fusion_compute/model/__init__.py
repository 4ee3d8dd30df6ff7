"""The model, knowing nothing of sharding: its config, the architecture table every consumer reads,
the kernels every layer shares, the weight-source protocol it reads through, the decoder layer (written once, over the ops each execution
implements), the dense twin, and transformers as the reference.

May import: errors. Not weights/ (the formats implement the model's WeightSource protocol,
model/source.py, and import the model's config: one way), nothing that shards or runs a job."""
