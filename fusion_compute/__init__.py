"""Fusion Compute: exact LLM inference with the execution state sharded across workers.

Client (user side): tokenizer, embedding, final norm, LM head, sampling (client.py, generate.py).
Workers: weight slices, residual and KV shards, sharded operators (worker.py, ops.py).
The plan (plan.py) says who owns which coordinates; comm/ is the only door to the wire, and within
it comm/torch_fabric.py is the only module that imports torch.distributed (tests/test_structure.py).
"""

__version__ = "0.1.0"
