"""engram_train: DeepSeek Engram conditional memory for megatron-core GPT models."""
