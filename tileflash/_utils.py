"""Small shared helpers: interpreter detection, device queries, integer maths, input checks.

Every check raises before any kernel launch and names the argument, what was expected and what was given.
"""
from __future__ import annotations

import functools
import math
import operator
import os

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
MAX_LATENT_DIM = 512  # MLA (qv): DeepSeek-V2/V3's latent width; wider accumulators would not fit the registers

# The Triton interpreter holds bf16 as raw uint16 and does arithmetic on the bits, so kernels widen tiles to fp32
# when interpreting (a constexpr; GPU numerics are untouched). Tests switch this off to show a bf16 test can fail.
INTERPRETER_UPCAST = True

# Tests set this so every output buffer starts as NaN: an element a kernel forgets to write then fails the test.
POISON_OUTPUTS = False


def is_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def upcast_tiles() -> bool:
    return is_interpreter() and INTERPRETER_UPCAST


def tile_dtype(dtype: torch.dtype):
    """The Triton dtype attention tiles are computed in: the query dtype, or fp32 when the interpreter upcasts."""
    import triton.language as tl

    return tl.float32 if upcast_tiles() else {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
                                              torch.float8_e4m3fn: tl.float8e4nv}[dtype]


@functools.lru_cache(maxsize=None)
def _cuda_properties_of(index: int):
    return torch.cuda.get_device_properties(index)


def _cuda_properties(device: torch.device):
    """The (cached) properties of a CUDA device; an index-less device means the current one."""
    return _cuda_properties_of(device.index if device.index is not None else torch.cuda.current_device())


def check_fp8_hardware(name: str, t: torch.Tensor) -> None:
    """FP8 / NVFP4 kernels convert e4m3 with sm_89+ instructions (Ada, Hopper and newer): refuse older GPUs here
    rather than fail in the GPU compiler."""
    if t.is_cuda:
        props = _cuda_properties(t.device)
        if (props.major, props.minor) < (8, 9):
            raise ValueError(f"{name}: FP8 and NVFP4 kernels need a GPU with compute capability 8.9 or newer "
                             f"(e4m3 conversions), got {props.major}.{props.minor}")


def words_aligned(t: torch.Tensor, dims: int) -> bool:
    """A byte tensor can be read as int32 words along its last dim: 4-byte aligned base and leading strides."""
    return t.data_ptr() % 4 == 0 and all(st % 4 == 0 for st in t.stride()[:dims])


def num_sms(device: torch.device) -> int:
    """Multiprocessor count; on the CPU (interpreter) a fixed H200-like 132 keeps heuristics deterministic."""
    if device.type == "cuda":
        return _cuda_properties(device).multi_processor_count
    return 132


def new_output(shape, dtype, device) -> torch.Tensor:
    """A contiguous tensor of `shape` (at least one dim). The sizes go in as separate ints: torch parses them ~0.5 us
    faster than one tuple (1.1 vs 1.6 us a call on the CPU stand-in)."""
    t = torch.empty(*shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if POISON_OUTPUTS else t


def new_output_like(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of t's shape and dtype (empty_like: a third of torch.empty's host time)."""
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def eager_or_op(op, impl, grad: bool = False):
    """The torch.library custom op while torch.compile traces or when autograd must record the call (the op
    carries the registered backward); otherwise the plain implementation, because the op's dispatch adds tens of
    microseconds to every decode step."""
    return op if grad or torch.compiler.is_compiling() else impl


def compiler_disabled(fn):
    """torch.compiler.disable(fn), made at the first call (inside a torch.compile trace, where torch._dynamo is
    loaded anyway): disabling at import would import torch._dynamo with tileflash, ~2 s of every `import
    tileflash`. Dynamo treats the disabled function made during its trace as one made before: it runs eagerly."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)
    return call


def needs_grad(*tensors) -> bool:
    """Whether autograd must record a call on these tensors (a non-tensor is an absent or not yet checked input)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def check_tensor(name: str, t, ndim: int | None = None, dtypes=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if device is None and t.device.type != "cuda":  # the call's first tensor: its device must run the kernels
        check_runnable_device(name, t)


def check_runnable_device(name: str, t: torch.Tensor) -> None:
    """The kernels run on CUDA devices; tensors elsewhere (CPU) only under Triton's interpreter or a Triton driver
    whose device they are on (the sm_90 stand-in of bench/standin.py). Without this, a CPU tensor failed at the
    launch with triton's '0 active drivers' (no GPU) or a pointer error (a GPU machine)."""
    if is_interpreter():
        return
    from triton.runtime import driver

    try:
        runs_here = driver.active.get_active_torch_device().type == t.device.type
    except RuntimeError:  # no GPU driver at all
        runs_here = False
    if not runs_here:
        raise ValueError(f"{name}: expected a CUDA tensor, got one on {t.device} (tileflash's kernels run on CUDA "
                         "GPUs; CPU tensors run only under Triton's interpreter, TRITON_INTERPRET=1)")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be contiguous (stride 1), got stride {t.stride(-1)}")


def check_head_dim(d: int) -> None:
    """Any head dim up to MAX_HEAD_DIM: the kernels pad it to a power of two in registers, never in memory (TMA and
    the Gluon kernels take only the dims and strides they can address; the rest load by masked pointers)."""
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim: expected 1..{MAX_HEAD_DIM}, got {d}")


WINDOW_UNBOUNDED_FROM = 2 ** 30  # a window this wide covers any sequence int32 positions can index


def check_window(window_size) -> tuple[int, int]:
    """(left, right) as ints >= -1. A negative bound is unbounded (-1), as flash-attn takes it; so is one of
    WINDOW_UNBOUNDED_FROM or more: the kernels add windows to int32 positions, and 2**31 - 1 there wrapped around
    and masked every key."""
    if isinstance(window_size, torch.Tensor):  # flash-attn accepts a tensor of two ints
        window_size = window_size.tolist()
    try:
        left, right = (operator.index(w) for w in window_size)  # ints and int-likes; floats are refused
    except (TypeError, ValueError):
        raise TypeError(f"window_size: expected a pair of ints (left, right), got {window_size!r}") from None
    return tuple(-1 if w < 0 or w >= WINDOW_UNBOUNDED_FROM else w for w in (left, right))


def check_alibi_slopes(alibi_slopes, batch: int, num_heads: int, device) -> None:
    """flash-attn's alibi_slopes (None: no ALiBi): fp32 [Hq] (every sequence's) or [batch, Hq], last dim
    contiguous (the kernels read slope b * stride(0) + head)."""
    if alibi_slopes is None:
        return
    check_tensor("alibi_slopes", alibi_slopes, dtypes=(torch.float32,), device=device)
    if tuple(alibi_slopes.shape) not in ((num_heads,), (batch, num_heads)):
        raise ValueError(f"alibi_slopes: expected shape [{num_heads}] or [{batch}, {num_heads}] (Hq, or batch x Hq), "
                         f"got {tuple(alibi_slopes.shape)}")
    check_last_dim_contiguous("alibi_slopes", alibi_slopes)


def check_learnable_sink(learnable_sink, num_heads: int, device) -> None:
    """FA4's learnable_sink (None: no sink): fp32 [Hq] on q's device, contiguous (the kernels read sink[head])."""
    if learnable_sink is None:
        return
    check_tensor("learnable_sink", learnable_sink, dtypes=(torch.float32,), device=device)
    if tuple(learnable_sink.shape) != (num_heads,):
        raise ValueError(f"learnable_sink: expected shape [{num_heads}] (one logit per query head), "
                         f"got {tuple(learnable_sink.shape)}")
    if not learnable_sink.is_contiguous():
        raise ValueError(f"learnable_sink: expected a contiguous tensor, got strides {learnable_sink.stride()}")


def check_int32(name: str, t, ndim: int, device) -> None:
    check_tensor(name, t, ndim=ndim, dtypes=(torch.int32,), device=device)


def as_int(name: str, x) -> int:
    """x as a Python int (ints and int-likes such as numpy ints or 0-dim integer tensors; floats are refused)."""
    try:
        return operator.index(x)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {x!r}") from None


def finite_float(name: str, x) -> float:
    """x as a finite float (numbers and 0-dim tensors; a tensor with dimensions is a misplaced argument, e.g. FA3's
    seqused_k passed positionally, which float() would take when it holds one element)."""
    if isinstance(x, torch.Tensor) and x.dim():
        raise TypeError(f"{name}: expected a number, got a tensor of shape {tuple(x.shape)}")
    try:
        x = float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a number, got {x!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{name}: expected a finite number, got {x}")
    return x


class CacheCapacityError(ValueError, RuntimeError):
    """A KV cache too small for the call: a ValueError like every argument error here, and a RuntimeError like
    flash-attn's, so callers catching either see it."""


def softmax_scale_or_default(softmax_scale, head_dim: int) -> float:
    return head_dim ** -0.5 if softmax_scale is None else finite_float("softmax_scale", softmax_scale)


def default_scale(softmax_scale, q, qv) -> float:
    """softmax_scale, else 1 / sqrt of the score's dot length: q's head dim, with FA3's qv (MLA) q's and qv's."""
    return softmax_scale_or_default(softmax_scale, q.shape[-1] + (qv.shape[-1] if qv is not None else 0))


def check_dropout(dropout_p, **unsupported) -> float:
    """flash-attn 2.x's dropout_p as a float in [0, 1); unsupported: name -> value of arguments that do not combine
    with dropout (a truthy value raises)."""
    p = finite_float("dropout_p", dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1), got {dropout_p}")
    if p:
        for name, value in unsupported.items():
            if value:
                raise ValueError(f"dropout_p: attention dropout does not combine with {name}")
    return p


def dropout_seed(device: torch.device) -> torch.Tensor:
    """The int64 seed [1] of one call's dropout pattern, drawn from torch's generator of the device (so
    torch.manual_seed reproduces it, and a captured CUDA graph draws a new one at every replay); the backward
    reuses it."""
    return torch.randint(1 << 62, (1,), dtype=torch.int64, device=device)


def check_fa3_tail(num_splits=0, pack_gqa=None, sm_margin=0, **unsupported) -> None:
    """FA3's arguments that tileflash takes for drop-in calls. num_splits, pack_gqa and sm_margin tune FA3's
    schedule ("can be tuned for speed"; sm_margin leaves SMs free for communication) and never change its results:
    they are checked and accepted, and tileflash's planner chooses its own schedule (its grids do not reserve SMs).
    Any argument in `unsupported` that is not None or 0 is refused, before any launch."""
    if as_int("num_splits", num_splits) < 0:
        raise ValueError(f"num_splits: expected >= 0, got {num_splits}")
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise ValueError(f"pack_gqa: expected None, True or False, got {pack_gqa!r}")
    if as_int("sm_margin", sm_margin) < 0:
        raise ValueError(f"sm_margin: expected >= 0, got {sm_margin}")
    for name, value in unsupported.items():
        if value is not None and not (isinstance(value, int) and value == 0):
            raise NotImplementedError(f"{name}: not supported here (expected None or 0, got {value!r})")


def check_attention_chunk(attention_chunk) -> int:
    """FA3's attention_chunk: 0 (off) or a positive chunk length in key positions."""
    chunk = as_int("attention_chunk", attention_chunk)
    if chunk < 0:
        raise ValueError(f"attention_chunk: expected >= 0 (0: off), got {attention_chunk}")
    return chunk


def check_block_table_values(block_table: torch.Tensor, used_tokens, page_size: int, num_pages: int) -> None:
    """The pages each sequence uses (its first cdiv(used_tokens[i], page_size) entries) lie in [0, num_pages).
    Reads device values: callers run it on request (validate=True) or where it costs no sync (CPU tensors)."""
    table = block_table.cpu()
    for i, n in enumerate(used_tokens):
        used = table[i, : cdiv(max(int(n), 0), page_size)]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
            raise ValueError(f"block_table: row {i} must use page indices in [0, {num_pages}), got min "
                             f"{int(used.min())}, max {int(used.max())}")
