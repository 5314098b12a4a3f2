"""A serving engine over a paged KV cache with continuous batching.

Pages: the KV pool of each layer is [num_pages + 1, page_size, Hkv, D]; `PageAllocator` hands out pages
0..num_pages-1 from a free list and the extra last page (`pad_page`) belongs to nobody: padding rows of a
CUDA-graph batch point at it, so their in-call appends scribble there and nowhere else.

Scheduling, one engine step at a time: requests that have arrived are admitted in arrival order while a batch slot
is free and the pool can hold their whole lifetime (prompt + max_new_tokens - 1 tokens, counted against the
pages already promised to running requests, so growing a running request never fails and nothing is preempted);
the admitted prompts are prefilled together as one varlen batch (flash_attn_varlen_func, their K/V written into
their pages), then every running request decodes one token (tileflash.decode_plan once per step, plan.run per
layer, with block_table, cache_seqlens and the new token's k/v appended in the call). Pages are taken as a sequence
grows into them and returned when it finishes; the next step's admissions can use them.

On a GPU each decode step replays a CUDA graph captured for the batch size rounded up to a power of two: the
step's tokens, cache_seqlens and block_table are copied into the graph's static input buffers before the replay.
`backend="sdpa"` swaps the two tileflash calls for torch SDPA (per-sequence prefill; decode over the pages gathered
into a padded [B, max_pages * page_size] cache with a length mask), leaving everything else the same.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

import tileflash
from tileflash._utils import cdiv, next_pow2


@dataclass
class Request:
    """A prompt and how many tokens to generate; the engine fills in the rest."""
    rid: int
    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0  # the engine step at which the request arrives
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # fp32 [vocab] per output token, if recorded
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    admitted: int | None = None
    finished: int | None = None

    @property
    def lifetime_tokens(self) -> int:
        # The last generated token is never fed back, so it never reaches the cache.
        return len(self.prompt) + self.max_new_tokens - 1


class PageAllocator:
    """A free list of page indices 0..num_pages-1."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError("page pool exhausted (the scheduler's page accounting is wrong)")
        return self._free.pop()

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


@dataclass
class RunStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    decode_batch_sizes: list[int] = field(default_factory=list)


def _tileflash_prefill(q, k, v, cu_seqlens, lens):
    return tileflash.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max(lens), max(lens), causal=True)


def _sdpa_prefill(q, k, v, cu_seqlens, lens):
    outs, start = [], 0
    for n in lens:
        qs, ks, vs = (t[None, start:start + n].transpose(1, 2) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


def _tileflash_decode_step(seqlens, table, plans: dict):
    """The decode step's attention per layer through one tileflash.decode_plan per batch size (made at the first
    layer that needs it, from its tensors' layout; seqlens and table are the engine's static buffers, whose values
    change in place), plan.run per layer."""
    def attn(q, k, v, k_cache, v_cache):
        q, k, v = q[:, None], k[:, None], v[:, None]
        plan = plans.get(q.shape[0])
        if plan is None:
            plan = plans[q.shape[0]] = tileflash.decode_plan(q, k_cache, v_cache, seqlens, block_table=table, k=k,
                                                             v=v, causal=True)
        return plan.run(q, k_cache, v_cache, k, v)[:, 0]

    return attn


def _sdpa_decode_step(seqlens, table, plans: dict):
    return lambda q, k, v, k_cache, v_cache: _sdpa_decode(q, k, v, k_cache, v_cache, seqlens, table)


def _sdpa_decode(q, k, v, k_cache, v_cache, seqlens, table):
    page_size, pos = k_cache.shape[1], seqlens.long()
    # Append the new token at position seqlens, then attend over the gathered pages up to and including it.
    slot = table.gather(1, (pos // page_size)[:, None])[:, 0].long() * page_size + pos % page_size
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot, v)
    keys, values = (c[table.long()].flatten(1, 2).transpose(1, 2) for c in (k_cache, v_cache))
    visible = torch.arange(keys.shape[2], device=q.device)[None, :] <= pos[:, None]
    return F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=visible[:, None, None],
                                          enable_gqa=True)[:, :, 0]


BACKENDS = {"tileflash": (_tileflash_prefill, _tileflash_decode_step), "sdpa": (_sdpa_prefill, _sdpa_decode_step)}


class Engine:
    """Greedy generation for a list of fresh `Request`s (see the module docstring). `run` can be called again with
    new requests; CUDA graphs captured by one run are replayed by the next."""

    def __init__(self, model, num_pages: int, page_size: int, max_batch: int, max_seq_len: int,
                 backend: str = "tileflash", cuda_graphs: bool | None = None, record_logits: bool = False):
        cfg, device = model.cfg, model.lm_head.weight.device
        if max_seq_len > cfg.max_positions:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's {cfg.max_positions} RoPE positions")
        self.model, self.page_size, self.max_batch, self.max_seq_len = model, page_size, max_batch, max_seq_len
        self.prefill_attn, self.decode_step = BACKENDS[backend]
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.record_logits = record_logits
        # tileflash takes fp16/bf16 only: an fp32 model (the CPU check) runs its attention and cache in fp16.
        model_dtype = model.lm_head.weight.dtype
        self.attn_dtype = model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.float16
        self.allocator = PageAllocator(num_pages)
        self.pad_page = num_pages
        shape = (cfg.layers, num_pages + 1, page_size, cfg.kv_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.attn_dtype, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)
        # Static decode inputs: eager steps use their first n rows, graph replays read them in place.
        rows = next_pow2(max_batch)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.seqlens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.block_table = torch.full((rows, cdiv(max_seq_len, page_size)), self.pad_page, dtype=torch.int32,
                                      device=device)
        self._graphs = {}
        self._decode_plans = {}  # batch size -> tileflash.DecodePlan (tileflash backend)

    # ---- scheduling -------------------------------------------------------------------------------------------
    def run(self, requests: list[Request]) -> RunStats:
        for r in requests:
            pages = cdiv(r.lifetime_tokens, self.page_size)
            if r.lifetime_tokens > self.max_seq_len or pages > self.allocator.num_pages:
                raise ValueError(f"request {r.rid}: {r.lifetime_tokens} tokens do not fit max_seq_len "
                                 f"{self.max_seq_len} or the pool of {self.allocator.num_pages} pages")
            if r.max_new_tokens < 1 or not r.prompt:
                raise ValueError(f"request {r.rid}: needs a non-empty prompt and max_new_tokens >= 1")
        stats = RunStats()
        waiting = deque(sorted(requests, key=lambda r: r.arrival))
        running: list[Request] = []
        step = 0
        while waiting or running:
            if not running and waiting[0].arrival > step:
                step = waiting[0].arrival  # idle: jump to the next arrival
            admitted = self._admit(waiting, running, step)
            if admitted:
                self._prefill(admitted)
                stats.prompt_tokens += sum(len(r.prompt) for r in admitted)
                running += admitted
            running = self._retire(running, step)  # max_new_tokens == 1 ends at prefill
            if running:
                self._decode(running)
                stats.decode_batch_sizes.append(len(running))
                running = self._retire(running, step)
            step += 1
        stats.steps = step
        stats.new_tokens = sum(len(r.output) for r in requests)
        return stats

    def _admit(self, waiting: deque, running: list[Request], step: int) -> list[Request]:
        promised = sum(cdiv(r.lifetime_tokens, self.page_size) for r in running)
        admitted = []
        while waiting and waiting[0].arrival <= step and len(running) + len(admitted) < self.max_batch:
            need = cdiv(waiting[0].lifetime_tokens, self.page_size)
            if promised + need > self.allocator.num_pages:
                break  # first come, first served: later arrivals wait behind this one
            promised += need
            admitted.append(waiting.popleft())
            admitted[-1].admitted = step
        return admitted

    def _retire(self, running: list[Request], step: int) -> list[Request]:
        for r in running:
            if len(r.output) == r.max_new_tokens:
                self.allocator.free(r.pages)
                r.pages, r.finished = [], step
        return [r for r in running if r.finished is None]

    def _grow(self, r: Request, num_tokens: int) -> None:
        while len(r.pages) * self.page_size < num_tokens:
            r.pages.append(self.allocator.alloc())

    def _emit(self, requests: list[Request], logits: torch.Tensor) -> None:
        for r, tok in zip(requests, logits.argmax(-1).tolist()):
            r.output.append(tok)
        if self.record_logits:
            for r, row in zip(requests, logits.float().cpu()):
                r.logits.append(row)

    # ---- model steps ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _prefill(self, requests: list[Request]) -> None:
        device = self.k_cache.device
        lens = [len(r.prompt) for r in requests]
        slots = []
        for r, n in zip(requests, lens):
            self._grow(r, n)
            slots += [r.pages[p // self.page_size] * self.page_size + p % self.page_size for p in range(n)]
            r.num_cached = n
        slots = torch.tensor(slots, device=device)
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
        tokens = torch.tensor([t for r in requests for t in r.prompt], device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lens])

        def attn(layer, q, k, v):
            q_, k, v = (t.to(self.attn_dtype) for t in (q, k, v))
            for cache, new in ((self.k_cache[layer], k), (self.v_cache[layer], v)):
                cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, new)
            return self.prefill_attn(q_, k, v, cu, lens).to(q.dtype)

        hidden = self.model(tokens, positions, attn)
        self._emit(requests, self.model.logits(hidden[cu[1:].long() - 1]))

    def _decode_forward(self, b: int) -> torch.Tensor:
        """Logits [b, vocab] for the first b rows of the static inputs; the new tokens' K/V land in the cache."""
        seqlens, table = self.seqlens[:b], self.block_table[:b]
        dt = self.attn_dtype
        step = self.decode_step(seqlens, table, self._decode_plans)

        def attn(layer, q, k, v):
            return step(q.to(dt), k.to(dt), v.to(dt), self.k_cache[layer], self.v_cache[layer]).to(q.dtype)

        return self.model.logits(self.model(self.tokens[:b], seqlens.long(), attn))

    @torch.no_grad()
    def _decode(self, running: list[Request]) -> None:
        n = len(running)
        b = next_pow2(n) if self.cuda_graphs else n
        # Capture (first use of b) before filling the inputs: it resets rows :b to padding.
        step_fn = self._graph(b) if self.cuda_graphs else lambda: self._decode_forward(b)
        table = torch.full((b, self.block_table.shape[1]), self.pad_page, dtype=torch.int32)
        for i, r in enumerate(running):
            self._grow(r, r.num_cached + 1)
            table[i, :len(r.pages)] = torch.tensor(r.pages, dtype=torch.int32)
        # Padding rows: token 0 at length 0 in the pad page.
        self.tokens[:b].copy_(torch.tensor([r.output[-1] for r in running] + [0] * (b - n)))
        self.seqlens[:b].copy_(torch.tensor([r.num_cached for r in running] + [0] * (b - n), dtype=torch.int32))
        self.block_table[:b].copy_(table)
        logits = step_fn()
        for r in running:
            r.num_cached += 1
        self._emit(running, logits[:n])

    def _graph(self, b: int):
        """A replay function for batch size b, captured on first use while rows :b are padding (the warm-up
        launches then write only into the pad page)."""
        if b not in self._graphs:
            from tileflash.bench.timing import graphed

            self.tokens[:b].zero_()
            self.seqlens[:b].zero_()
            self.block_table[:b].fill_(self.pad_page)
            self._graphs[b] = graphed(lambda: self._decode_forward(b))
        return self._graphs[b]
