"""tileflash: FlashAttention-class attention kernels in Triton (prefill, varlen, split-KV paged decode)."""
from .ops.kvcache import DecodePlan, decode_plan, flash_attn_with_kvcache
from .lowp.gemm import nvfp4_matmul
from .ops.merge import merge_attn_states
from .ops.packed import (flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_kvpacked_func,
                         flash_attn_varlen_qkvpacked_func)
from .ops.prefill import flash_attn_func, flash_attn_varlen_func
from .lowp.quant import fp8_dequantize, fp8_quantize, fp8_quantize_qkv, nvfp4_dequantize, nvfp4_quantize

__version__ = "0.1.0"

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "decode_plan", "DecodePlan",
           "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "merge_attn_states",
           "nvfp4_quantize", "nvfp4_dequantize", "nvfp4_matmul", "fp8_quantize", "fp8_dequantize",
           "fp8_quantize_qkv", "__version__"]
