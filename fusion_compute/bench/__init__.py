"""`fusion bench`: this runtime vs one transformers process vs a Megatron-style baseline."""
