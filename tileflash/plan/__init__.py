"""Policy: pure functions from shapes (and the target) to frozen configs, tested by properties and anchor rows in
tests/plan/. What a call launches is decided here; the launch layer (tileflash.launch) only turns the choice into
arguments. Measured reasons for each choice are in the docstrings; the numbers they cite are in benchmarks/results/
and, as "notebook, run N", in benchmarks/archive/notebook-2026-11.md; the scripts they name (sweep.py,
config_sweep.py, ws_sweep.py, ws_bwd_sweep.py, splits_sweep.py, decode_quant_sweep.py, gemm_mma_sweep.py) were
folded into `python -m tileflash sweep`. Overrides for sweeps and tests: tileflash.config.override."""
from .target import (SHARED_MEM_PER_BLOCK, has_tma, mma_sync_target, padded_head_dim, sm90_target,  # noqa: F401
                     small_shared_memory, target_arch, tensor_memory, tma_4d_ok, tma_aligned)
from .prefill import (FwdConfig, Mask, ONE_WARPGROUP_MAX_KEYS, WsFwdConfig, fwd_config, fwd_ws_config,
                     split_head_dim, tma_tiles, ws_call_ok, ws_forward_config)  # noqa: F401
from .backward import BwdConfig, WsBwdConfig, bwd_config, bwd_ws_config, ws_backward_config  # noqa: F401
from .decode import (COMBINE_TILE, DECODE_TILES, DecodeConfig, DecodeSchedule, GATHER_PROGRAMS_PER_SM,
                    KV_ELEMENT_BYTES, KV_FORMATS, LARGE_TILES_MIN_KV, LONG_PROGRAM_TOKENS, LONG_SPLIT_PROGRAMS_PER_SM,
                    MAX_DECODE_TOKENS, MAX_MERGE_LOADS, MAX_SPLITS, MERGE_MAX_KV_BYTES, MERGE_TILE, MIN_SPLIT_TOKENS,
                    MLA_TILES, MlaGluonConfig, PAGED_FP8_MIN_SPLITS, QUANT_MMA_HEAD_DIMS, QUANT_MMA_MAX_ROWS,
                    QUANT_MMA_SMALL_STEP_MIN_TOKENS, QUANT_MMA_SMALL_STEP_PROGRAMS, QUANT_MMA_SMALL_STEP_SHORT_PROGRAMS,
                    QuantDecodeConfig, SHORT_SPLIT_TOKENS, cache_capacity, combine_pdl, combine_tiles, decode_block_m,
                    decode_config, decode_schedule, fused_combine_rule, merge_tiles, mla_decode_config,
                    mla_gluon_config, mla_gluon_rows, num_splits_heuristic, quant_decode_config, quant_mma_config,
                    split_plan)  # noqa: F401
from .gemm import (GEMM_MMA_MAX_M, GEMM_MMA_MAX_TILES, GEMM_MMA_PROGRAMS_PER_SM, GEMM_MMA_SLICE_STEPS,
                   GEMM_WGMMA_MAX_M, GemmConfig, GemmDecodedConfig, GemmMmaConfig, GemmWgmmaConfig, gemm_config,
                   gemm_decoded_config, gemm_mma_config, gemm_wgmma_config)  # noqa: F401
