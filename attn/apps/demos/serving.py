"""Serving with a paged KV cache: chunked prefill and batched decode through attn.flash.

Three requests of different prompt lengths share one pool of 16-key pages.
A page allocator of a few lines hands out pages from a free list (shuffled,
as a server's pool is after a while); each request's block table lists its
pages in order. Every step is one call of FlashAttention's API:

* prefill in chunks of at most CHUNK tokens, all requests' chunks in one
  ``flash_attn_varlen_func(..., block_table=...)`` call (the chunk's keys and
  values are first written into the pages, as a model's layer would);
* then decode: one ``flash_attn_with_kvcache`` call per step for all three
  requests, appending each one's new key and value in place at its own
  length and attending over its own pages.

The model is random (queries, keys and values drawn per token): the point is
the bookkeeping. Each step is checked against float64 attention over each
request's keys gathered out of its pages.
"""

from dataclasses import dataclass, field

import numpy as np

from attn._api import scaled_dot_product_attention
from attn.flash import flash_attn_varlen_func, flash_attn_with_kvcache

PAGE, CHUNK, H, H_KV, E = 16, 64, 8, 2, 64
PROMPTS = (150, 37, 90)  # prompt tokens of the three requests
DECODE_STEPS = 5
SEED = 20261203


class PageAllocator:
    """Pages of a pool, handed out from a free list and returned when a request ends."""

    def __init__(self, n_pages, rng):
        self.free = list(rng.permutation(n_pages))

    def take(self, n):
        if n > len(self.free):
            raise MemoryError(f"the pool has {len(self.free)} free pages, {n} asked")
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def give(self, pages):
        self.free.extend(pages)


@dataclass
class Request:
    prompt: int
    length: int = 0  # keys in the cache
    pages: list = field(default_factory=list)

    def reserve(self, allocator, n_new):
        """Pages for n_new more keys."""
        need = -(-(self.length + n_new) // PAGE) - len(self.pages)
        if need > 0:
            self.pages += allocator.take(need)


@dataclass
class Step:
    kind: str  # "prefill" or "decode"
    rows: tuple  # query rows per request
    keys: tuple  # keys each request attends to
    max_error: float  # against float64 over the gathered keys


def _table(requests):
    width = max(len(r.pages) for r in requests)
    return np.array([r.pages + [0] * (width - len(r.pages)) for r in requests], np.int32)


def _reference_error(out, q, k_pages, v_pages, requests, rows):
    err, at = 0.0, 0
    for r, n in zip(requests, rows):
        if n == 0:  # (a request whose prompt is done waits for decode)
            continue
        pages = np.array(r.pages)
        k = k_pages[pages].reshape(-1, H_KV, E)[: r.length].astype(np.float64)
        v = v_pages[pages].reshape(-1, H_KV, E)[: r.length].astype(np.float64)
        ref = scaled_dot_product_attention(q[at:at + n].transpose(1, 0, 2).astype(np.float64), k.transpose(1, 0, 2),
                                           v.transpose(1, 0, 2), is_causal="lower_right", enable_gqa=True,
                                           backend="numpy")
        err = max(err, float(np.abs(out[at:at + n] - ref.transpose(1, 0, 2)).max()))
        at += n
    return err


def run():
    """The steps of the three requests: prefill chunks, then batched decode."""
    rng = np.random.default_rng(SEED)
    n_pages = 64
    k_pages = np.zeros((n_pages, PAGE, H_KV, E), np.float32)  # the pool: [num_blocks, page, H_kv, E]
    v_pages = np.zeros_like(k_pages)
    allocator = PageAllocator(n_pages, rng)
    requests = [Request(p) for p in PROMPTS]
    steps = []
    while any(r.length < r.prompt for r in requests):  # chunked prefill, every request's chunk in one call
        rows = [min(CHUNK, r.prompt - r.length) for r in requests]
        q = rng.standard_normal((sum(rows), H, E), np.float32)
        for r, n in zip(requests, rows):  # the layer writes the chunk's keys and values into the pages
            r.reserve(allocator, n)
            for i in range(n):
                page, slot = r.pages[(r.length + i) // PAGE], (r.length + i) % PAGE
                k_pages[page, slot] = rng.standard_normal((H_KV, E))
                v_pages[page, slot] = rng.standard_normal((H_KV, E))
            r.length += n
        cu_q = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum([r.length for r in requests])]).astype(np.int32)
        out = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(rows), max(r.length for r in requests),
                                     causal=True, block_table=_table(requests))
        steps.append(Step("prefill", tuple(rows), tuple(r.length for r in requests),
                          _reference_error(out, q, k_pages, v_pages, requests, rows)))
    for _ in range(DECODE_STEPS):  # batched decode: one call appends and attends for all requests
        q = rng.standard_normal((len(requests), 1, H, E), np.float32)
        k_new = rng.standard_normal((len(requests), 1, H_KV, E), np.float32)
        v_new = rng.standard_normal((len(requests), 1, H_KV, E), np.float32)
        for r in requests:
            r.reserve(allocator, 1)
        lengths = np.array([r.length for r in requests], np.int32)
        out = flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, cache_seqlens=lengths,
                                      block_table=_table(requests), causal=True)
        for r in requests:
            r.length += 1
        steps.append(Step("decode", (1,) * len(requests), tuple(r.length for r in requests),
                          _reference_error(out[:, 0], q[:, 0], k_pages, v_pages, requests, [1] * len(requests))))
    for r in requests:  # the requests end: their pages go back to the pool
        allocator.give(r.pages)
    return steps


def report(steps):
    lines = [f"Three requests (prompts of {', '.join(map(str, PROMPTS))} tokens) over one pool of {PAGE}-key pages,",
             f"H={H} query heads over {H_KV} key/value heads, E={E}, float32; prefill chunks of at most {CHUNK} rows.",
             "Each step is one attn.flash call; error: max |out - float64 over the gathered pages|.", "",
             f"{'step':<8} {'query rows':>14} {'keys attended':>16} {'max |err|':>10}"]
    for s in steps:
        lines.append(f"{s.kind:<8} {','.join(map(str, s.rows)):>14} {','.join(map(str, s.keys)):>16} "
                     f"{s.max_error:>10.2e}")
    return "\n".join(lines)
