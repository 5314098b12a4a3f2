"""Check the engine's greedy tokens against a full-recompute reference of the same model.

Teacher forcing: the reference runs once per request over prompt + output[:-1] and its argmax at each generated
position is compared with the engine's token. If every position agrees, the reference's own greedy decoding
produces exactly the engine's sequence (by induction over positions), so one forward pass per request suffices, and
after a disagreement the later positions are still compared on the same context.

Rounding: the reference runs twice, in fp32 (the target) and in the engine's precision (model dtype, attention
inputs and outputs rounded to the engine's attention dtype). Per output position, the engine's logits are within
rounding when max|engine - ref32| <= 2 * max|ref_lowp - ref32| + atol (the project's 2x rule). A token that differs
from the fp32 reference's where the engine's logits are within rounding is a near-tie that rounding flipped
legitimately; anything else is a mismatch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .engine import Request
from .model import LlamaModel, reference_logits

ATOL = 1e-4  # absolute floor of the rounding bound, for rows where the low-precision reference happens to be exact


@dataclass
class Mismatch:
    index: int  # position in the request's output
    engine_token: int
    reference_token: int
    margin: float  # fp32 reference logit of its top token minus that of the engine's token
    logit_diff: float  # max |engine logits - ref32| on this row
    bound: float  # 2 * max |ref_lowp - ref32| + ATOL on this row

    @property
    def near_tie(self) -> bool:
        return self.logit_diff <= self.bound


@dataclass
class CheckResult:
    rid: int
    max_logit_diff: float  # max |engine logits - ref32| over the request's outputs
    max_lowp_diff: float  # max |ref_lowp - ref32|: the rounding scale of the engine's precision
    logits_within_bound: bool
    mismatches: list[Mismatch]

    @property
    def ok(self) -> bool:
        """True unless a token differs by more than rounding can explain."""
        return all(m.near_tie for m in self.mismatches)

    @property
    def status(self) -> str:
        return "yes" if not self.mismatches else ("near-tie" if self.ok else "NO")


def check_request(model: LlamaModel, model32: LlamaModel, attn_dtype, r: Request) -> CheckResult:
    """r must come from an engine run with record_logits=True."""
    if len(r.logits) != len(r.output):
        raise ValueError(f"request {r.rid}: the engine did not record logits (record_logits=True)")
    tokens, rows = r.prompt + r.output[:-1], slice(len(r.prompt) - 1, None)
    ref32 = reference_logits(model32, tokens)[rows].cpu()
    lowp = reference_logits(model, tokens, attn_dtype)[rows].cpu()
    diff = (torch.stack(r.logits) - ref32).abs().amax(-1)
    bound = 2 * (lowp - ref32).abs().amax(-1) + ATOL
    mismatches = []
    for i, (tok, ref_tok) in enumerate(zip(r.output, ref32.argmax(-1).tolist())):
        if tok != ref_tok:
            mismatches.append(Mismatch(i, tok, ref_tok, float(ref32[i, ref_tok] - ref32[i, tok]), float(diff[i]),
                                       float(bound[i])))
    return CheckResult(r.rid, float(diff.max()), float((lowp - ref32).abs().max()), bool((diff <= bound).all()),
                       mismatches)


def describe(backend: str, result: CheckResult) -> list[str]:
    """One line per differing token, saying where and by how much."""
    return [f"request {result.rid} ({backend}): output token {m.index} is {m.engine_token}, the fp32 reference's is "
            f"{m.reference_token} (margin {m.margin:.3g}); engine max|dlogit| on that row {m.logit_diff:.3g} vs "
            f"rounding bound {m.bound:.3g} -> {'near-tie flipped by rounding' if m.near_tie else 'MISMATCH'}"
            for m in result.mismatches]
