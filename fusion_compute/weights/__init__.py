"""Where weights and tokenizers come from: model paths and the WeightSource protocol, safetensors
directories, GGUF files (per-slice dequantization), the tokenizer and chat template.

May import: errors, model.config and model.source (the protocol the formats implement). Never anything that runs a job."""
