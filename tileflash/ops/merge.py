"""merge_attn_states: join two partial attention results (cascade / shared-prefix and cross-GPU attention)."""
from __future__ import annotations

import torch

from .. import _utils
from ..launch import direct
from ..launch.forward import launch_merge


class MergePlan(direct.Replayable):
    def __init__(self, out_a, lse_a):
        self.device = out_a.device
        self.three_d = out_a.dim() == 3
        self.empty = out_a.numel() == 0

    def _launch(self, oa, la, ob, lb, out, lse) -> None:
        if self.three_d:  # [T, H, D] with lse [H, T] is the batch-1 case of [B, S, H, D] with [B, H, S]
            oa, la, ob, lb, out, lse = (direct.derived(t.unsqueeze(0), t) for t in (oa, la, ob, lb, out, lse))
        launch_merge(oa, la, ob, lb, out, lse)

    def run(self, out_a, lse_a, out_b, lse_b):
        out, lse = _utils.new_output_like(out_a), _utils.new_output_like(lse_a)
        if self.empty:  # nothing to launch for; an empty head dim still has LSEs to merge
            return out, torch.logaddexp(*(torch.where(t == float("inf"), float("-inf"), t) for t in (lse_a, lse_b)))
        self.execute(self._launch, (out_a, lse_a, out_b, lse_b, out, lse), direct.current_stream(self.device))
        return out, lse


_PLANS = direct.PlanCache()


def _merge_impl(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan cached on the four tensors' signature (checked before a new one is made: the checks see only what
    the signature holds), run. The key is spelled out: a generator over the four costs ~0.5 us more a call."""
    key = direct.tensor_key
    plan = direct.plan_for(_PLANS, lambda: (key(out_a), key(lse_a), key(out_b), key(lse_b)),
                           lambda: _check_merge(out_a, lse_a, out_b, lse_b) or MergePlan(out_a, lse_a))
    return plan.run(out_a, lse_a, out_b, lse_b)


_merge_op = torch.library.custom_op("tileflash::merge_attn_states", mutates_args=())(_merge_impl)


@_merge_op.register_fake
def _(out_a, lse_a, out_b, lse_b):
    return torch.empty_like(out_a), torch.empty_like(lse_a, memory_format=torch.contiguous_format)


def merge_attn_states(out_a, lse_a, out_b, lse_b):
    """Merge two partial results over disjoint key sets into the result over their union.

    out_* [B, S, H, D] with lse_* [B, H, S] (flash_attn_func / flash_attn_with_kvcache layouts), or out_* [T, H, D]
    with lse_* [H, T] (varlen layout); lse float32, natural log, -inf for a part that saw no key (it contributes
    nothing, whatever its out holds; flash-attn 2.x's +inf is taken the same way). Returns (out, lse) with out in
    out_a's dtype.
    """
    if torch.compiler.is_compiling():
        _check_merge(out_a, lse_a, out_b, lse_b)
        return _merge_op(out_a, lse_a, out_b, lse_b)
    return _merge_impl(out_a, lse_a, out_b, lse_b)


def _check_merge(out_a, lse_a, out_b, lse_b) -> None:
    _utils.check_tensor("out_a", out_a, dtypes=_utils.SUPPORTED_DTYPES + (torch.float32,))
    if out_a.dim() not in (3, 4):
        raise ValueError(f"out_a: expected [B, S, H, D] or [T, H, D], got shape {tuple(out_a.shape)}")
    _utils.check_tensor("out_b", out_b, ndim=out_a.dim(), dtypes=(out_a.dtype,), device=out_a.device)
    if out_b.shape != out_a.shape:
        raise ValueError(f"out_b: expected shape {tuple(out_a.shape)} (out_a's), got {tuple(out_b.shape)}")
    lse_shape = (out_a.shape[1], out_a.shape[0]) if out_a.dim() == 3 else \
        (out_a.shape[0], out_a.shape[2], out_a.shape[1])
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        _utils.check_tensor(name, t, ndim=len(lse_shape), dtypes=(torch.float32,), device=out_a.device)
        if tuple(t.shape) != lse_shape:
            raise ValueError(f"{name}: expected shape {lse_shape}, got {tuple(t.shape)}")
    for name, t in (("out_a", out_a), ("out_b", out_b)):
        _utils.check_last_dim_contiguous(name, t)
