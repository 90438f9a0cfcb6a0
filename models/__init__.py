"""Model specs: named GPT and Qwen configurations built as megatron-core GPTModels."""
