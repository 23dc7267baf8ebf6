"""Models: the Qwen2 / Qwen2.5 decoder, HF checkpoint import, tokenizers.

from earl_jax.models import hf_import, qwen2, tokenizer
"""

from earl_jax.models import hf_import, qwen2, tokenizer
from earl_jax.models.qwen2 import KVCache, Qwen2, init_model, token_logprobs

__all__ = ['KVCache', 'Qwen2', 'hf_import', 'init_model', 'qwen2', 'token_logprobs', 'tokenizer']
