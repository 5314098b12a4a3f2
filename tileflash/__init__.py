"""tileflash: FlashAttention-class attention kernels in Triton (prefill, varlen, split-KV paged decode)."""
from .ops.decode import flash_attn_with_kvcache
from .ops.merge import merge_attn_states
from .ops.prefill import flash_attn_func, flash_attn_varlen_func

__version__ = "0.1.0"

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "merge_attn_states",
           "__version__"]
