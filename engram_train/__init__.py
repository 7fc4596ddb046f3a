"""engram_train: DeepSeek Engram conditional memory for megatron-core GPT models."""
from engram_train.config import EngramConfig  # noqa: E402  (light: no torch, no megatron)
