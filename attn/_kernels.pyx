# The fused attention kernel: FlashAttention-2's forward pass (Dao, 2023,
# Algorithm 1) on the CPU, and the masked softmax.
#
# Layering: attn's Python side validates every argument and describes each
# operand (base pointer, per-matrix offsets, strides); the `def` functions at
# the end of this file only fill one attn_problem (attn/_src/attn_kernel.h,
# shared with C) and run the `noexcept nogil` cores, which never touch a
# Python object and return status bits raised after the nogil block.
#
# What is where:
#   this file               the algorithm (_flash_block), the work split and
#                           the thread pool, the Python entry points (attention,
#                           the compiled fast path sdpa_fast, masked_softmax,
#                           the bfloat16 casts, fma_peak)
#   _src/attn_kernel.h      the operand descriptor and attn_problem (variants,
#                           packed varlen table, pages, per-matrix lengths),
#                           every tuning knob (with its reason), the scratch
#                           layout, the dispatch table type
#   _src/attn_dispatch.h    the instruction-set paths (generic, avx2-fma,
#                           avx512, avx512-bf16, avx512-amx) and their choice
#   _src/attn_simd.h        one table of micro-kernels per path, chosen at import
#   _src/attn_simd_impl.h   the micro-kernels: score tile (+ mask, causal,
#                           variants), online-softmax update, P.V tile, merge
#   _src/attn_simd_ops.h    the vector operations of each instruction set
#   _src/attn_simd_exp.h    the vector exp and tanh (softcap)
#   _src/attn_simd_bf16dot.h, attn_simd_q8dot.h
#                           bfloat16 (vdpbf16ps, AMX tiles) and q8_0 (VNNI)
#                           products
#   _src/attn_backward*.h   the backward (attn._kernels_backward)
#   _src/attn_fma_peak.h    the benchmark's FMA-peak loop
#   _src/attn_omp.h         OpenMP or not, the debug build's switch
#
# Directives (setup.py): boundscheck/wraparound/initializedcheck are off in a
# normal build and on in the debug build (ATTN_DEBUG_BUILD=1), which also
# defines ATTN_DEBUG so every region a micro-kernel reads is checked against
# its array first.

from libc.stdint cimport int64_t, uint16_t, uint32_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset
from cython.parallel cimport parallel, prange

cimport numpy as cnp
import sys
import time

import numpy as np

from attn._attn_kernel cimport *  # what both extensions share with C (see that file)

cnp.import_array()

cdef extern from "attn_simd.h" nogil:
    ctypedef struct attn_ws:
        const char* k
        const char* v
        const char* mask
        int64_t i0, m_rs, nq
        int causal
        int window
        double alibi_slope
        const double* sinks
        int64_t sink_rows
    ctypedef struct attn_kernels:
        void (*begin)(const attn_problem*, attn_ws*, int64_t) noexcept nogil
        void (*load_q)(const attn_problem*, attn_ws*, const char*, int64_t, int64_t) noexcept nogil
        void (*scores)(const attn_problem*, attn_ws*, int64_t, int64_t) noexcept nogil
        void (*online_softmax)(attn_ws*, int64_t) noexcept nogil
        void (*pv)(const attn_problem*, attn_ws*, int64_t, int64_t) noexcept nogil
        void (*finish)(const attn_problem*, attn_ws*, void*, int64_t, void*) noexcept nogil
        void (*save_part)(const attn_problem*, attn_ws*, void*) noexcept nogil
        void (*weights)(attn_ws*, int64_t, void*, int64_t) noexcept nogil
        void (*merge)(const void*, int64_t, int64_t, int64_t, void*, int64_t, void*, const double*, int64_t) noexcept nogil
        void (*softmax_row)(const void*, int64_t, const void*, int, int64_t, void*, int64_t) noexcept nogil
    size_t attn_ws_layout(attn_ws* ws, char* base, size_t itemsize, int64_t d_k, int64_t d_v, int64_t bk)
    int64_t attn_part_elems(int64_t nq, int64_t d_v)
    const attn_kernels* attn_table(int kind)
    void attn_simd_init()
    const char* attn_simd_path()
    int attn_simd_available(const char** names, int n)
    int attn_simd_select(const char* name)
    int attn_simd_path_id
    void attn_tiles_release(const attn_problem* a)
    int64_t attn_key_tile(const attn_problem* a, int64_t nq)
    int attn_q8_rounds_query(const attn_problem* a)

attn_simd_init()  # pick the instruction-set path once, before any kernel runs


cdef int simd_path_id() noexcept nogil:
    """The instruction-set path the kernels run (ATTN_PATH_* of attn_dispatch.h).
    attn._kernels_backward cimports it (attn/_kernels.pxd) and runs the same
    path: one choice, at this module's import, and one switch (_select_simd)."""
    return attn_simd_path_id


# ==========================================================================
# The algorithm: FlashAttention-2 forward for one block of query rows
#
# Block i holds query rows Q_i (scaled by `scale`, packed in the scratch ws);
# the keys [j0, j1) are visited in tiles K_j, V_j of ATTN_BK rows. Per row r
# of the block the state is
#   m_i[r]  the largest visible score seen so far (-inf while none),
#   l_i[r]  sum over the visible keys seen so far of exp(score - m_i[r]),
#   O_i[r]  sum over the same keys of exp(score - m_i[r]) * v[key],
# and after every tile these hold for all keys [j0, kb + nk) exactly.
# A tile raises m_i to m_new and rescales l_i and O_i by the factor
# alpha = exp(m_i - m_new) (FlashAttention-2's diag(exp(m_old - m_new))),
# so the division by l_i happens once, at the end: out = O_i / l_i.
#
# -inf and empty rows: masked and non-causal keys get the score -inf, and
# exp(-inf) = 0 exactly, so they add nothing. While a row has seen nothing
# (m_new = -inf) the exponents are taken against 0 instead of m_new, which
# keeps exp(-inf - (-inf)) = NaN out; a row that saw no visible key ends with
# l_i = 0 and gets output 0 (as torch's CPU SDPA kernels; a plain softmax
# gives NaN) and lse -inf. A NaN score
# propagates through max, exp and the sums to its own row only.
#
# Thread count: every way work is cut (row blocks, heads per group, key
# chunks) is a function of the shape alone, each piece is computed by one
# thread in a fixed order, and chunks are merged in chunk order; so results
# are bitwise the same on 1 or n threads.
#
# Split keys (decode): with few query rows the keys are cut into chunks
# computed independently; each leaves its unnormalized (m_c, l_c, O_c), and
#   M = max_c m_c,  L = sum_c exp(m_c - M) l_c,  O = sum_c exp(m_c - M) O_c
# gives out = O / L and lse = M + log L, the same quantities as one pass
# (exact up to rounding; chunks that saw nothing have l_c = 0, O_c = 0).

cdef void _flash_block(const attn_problem* a, const attn_kernels* K, attn_ws* ws, int64_t b,
                       int64_t j0, int64_t j1, char* out, int64_t o_rs, char* lse, char* part,
                       char* pack) noexcept nogil:
    """Rows of ws (Q_i of matrix b, after K.begin and K.load_q) against keys [j0, j1):
    writes out rows (stride o_rs) and lse, or the partial state (m_i, l_i, O_i) into ``part``.
    A paged K/V: with ``pack`` (pages shorter than a tile, see _pack_size) each tile's rows are
    copied from their pages into ``pack`` and read there, so the tiles are those of a
    contiguous cache; otherwise a tile ends where its page does (_page_in)."""
    cdef int64_t kb = j0, nk, bk = attn_key_tile(a, ws.nq)   # ATTN_BK (ATTN_BK_AMX on AMX tiles)
    cdef attn_problem packed
    cdef const attn_problem* t = a     # the problem the micro-kernels read K, V rows through
    if pack != NULL:
        packed = a[0]
        packed.k.s_row, packed.k.s_col = _row_elems(a.kind, a.d_k), 1
        packed.v.s_row, packed.v.s_col = _row_elems(a.kind, a.d_v), 1
        t = &packed
    while kb < j1:
        nk = min(bk, j1 - kb)
        if pack != NULL:
            _pack_tile(a, ws, b, kb, nk, pack)
        elif a.pages != NULL:
            nk = _page_in(a, ws, b, kb, nk)
        K.scores(t, ws, kb, nk)        # S = Q_i K_j^T (+ mask); invisible -> -inf
        K.online_softmax(ws, nk)       # m_new = max(m_i, rowmax S); alpha = exp(m_i - m_new)
                                       # P = exp(S - m_new); l_i = alpha l_i + rowsum P; m_i = m_new
        K.pv(t, ws, kb, nk)            # O_i = diag(alpha) O_i + P V_j
        kb += nk
    if part != NULL:
        K.save_part(a, ws, part)       # (m_i, l_i, O_i), merged later
    else:
        K.finish(a, ws, out, o_rs, lse)    # out = O_i / l_i;  lse = m_i + log l_i


cdef inline int64_t _page_in(const attn_problem* a, attn_ws* ws, int64_t b, int64_t kb,
                           int64_t nk) noexcept nogil:
    """Point ws.k and ws.v at the page holding key kb of matrix b, so that the
    micro-kernels' row kb (ws.k + kb rows) is that page's row kb % page_size;
    the keys of the tile from kb that lie in this page (at most nk)."""
    cdef int64_t start = kb - kb % a.page_size
    cdef int64_t pg = a.pages[a.page_rows[b] + kb // a.page_size]
    cdef int64_t kvsz = <int64_t>attn_kind_kv_size(a.kind)
    ws.k = a.k.base + (a.k.offsets[b] + pg * a.k_page - start * a.k.s_row) * kvsz
    ws.v = a.v.base + (a.v.offsets[b] + pg * a.v_page - start * a.v.s_row) * kvsz
    return min(nk, start + a.page_size - kb)


cdef size_t _pack_size(const attn_problem* a, int64_t rows) noexcept nogil:
    """Bytes of one thread's tile copy of a paged K/V whose pages are shorter than a key tile
    (rows contiguous: s_col 1), 0 when tiles are read in place (_page_in) or K/V is not paged."""
    cdef int64_t bk = attn_key_tile(a, rows)
    if a.pages == NULL or a.page_size >= bk or a.k.s_col != 1 or a.v.s_col != 1:
        return 0
    return <size_t>(bk * (_row_elems(a.kind, a.d_k) + _row_elems(a.kind, a.d_v))) * attn_kind_kv_size(a.kind)


cdef void _pack_tile(const attn_problem* a, attn_ws* ws, int64_t b, int64_t kb, int64_t nk,
                     char* pack) noexcept nogil:
    """Copy keys [kb, kb + nk) of matrix b, page by page, into ``pack`` (K's rows, then V's, each
    contiguous) and point ws.k, ws.v there so that row kb is the copy's first."""
    cdef int64_t kvsz = <int64_t>attn_kind_kv_size(a.kind)
    cdef int64_t kw = _row_elems(a.kind, a.d_k), vw = _row_elems(a.kind, a.d_v)
    cdef char* kt = pack
    cdef char* vt = pack + nk * kw * kvsz
    cdef int64_t j, r, pg
    for j in range(nk):
        r = (kb + j) % a.page_size
        pg = a.pages[a.page_rows[b] + (kb + j) // a.page_size]
        memcpy(kt + j * kw * kvsz, a.k.base + (a.k.offsets[b] + pg * a.k_page + r * a.k.s_row) * kvsz, kw * kvsz)
        memcpy(vt + j * vw * kvsz, a.v.base + (a.v.offsets[b] + pg * a.v_page + r * a.v.s_row) * kvsz, vw * kvsz)
    ws.k = kt - kb * kw * kvsz
    ws.v = vt - kb * vw * kvsz


cdef bint _pages_ok(const attn_problem* a, int64_t b, int64_t j0, int64_t j1) noexcept nogil:
    """Debug builds: every page row of keys [j0, j1) of matrix b (K's and V's values,
    and a q8_0 row's scales) lies inside the cache arrays."""
    cdef int64_t j = j0, n, pg, r
    cdef int64_t kvsz = <int64_t>attn_kind_kv_size(a.kind)
    cdef int64_t kw = _row_elems(a.kind, a.d_k), vw = _row_elems(a.kind, a.d_v)
    cdef const char* kp
    cdef const char* vp
    while j < j1:
        r = j % a.page_size
        n = min(j1 - j, a.page_size - r)
        pg = a.pages[a.page_rows[b] + j // a.page_size]
        kp = a.k.base + (a.k.offsets[b] + pg * a.k_page + r * a.k.s_row) * kvsz
        vp = a.v.base + (a.v.offsets[b] + pg * a.v_page + r * a.v.s_row) * kvsz
        if not (addr_ok(&a.k, kp) and addr_ok(&a.k, kp + ((n - 1) * a.k.s_row + (kw - 1) * a.k.s_col) * kvsz)
                and addr_ok(&a.v, vp) and addr_ok(&a.v, vp + ((n - 1) * a.v.s_row + (vw - 1) * a.v.s_col) * kvsz)):
            return False
        j += n
    return True


cdef void _weights_pass(const attn_problem* a, const attn_kernels* K, attn_ws* ws,
                        int64_t jend, char* w, size_t itemsize) noexcept nogil:
    """return_weights: with the final m_i, l_i, recompute S tile by tile and
    write P = exp(S - m_i) / l_i (0 for keys past the causal horizon jend)."""
    cdef int64_t kb = 0, nk, nv, r
    while kb < a.n_k:
        nk = min(<int64_t>ATTN_BK, a.n_k - kb)
        nv = max(<int64_t>0, min(nk, jend - kb))   # keys of the tile before the horizon
        if nv > 0:
            # (grouped heads have ws.causal = 0: their horizon is jend alone, so the
            # scores must stop there, not at the tile's end)
            K.scores(a, ws, kb, nv)
            K.weights(ws, nv, w + kb * <int64_t>itemsize, a.n_k)
        if nv < nk:
            for r in range(ws.nq):
                memset(w + (r * a.n_k + kb + nv) * <int64_t>itemsize, 0, (nk - nv) * itemsize)
        kb += nk


# ==========================================================================
# Work items and their split

cdef struct Plan:
    int64_t heads       # query heads (consecutive matrices) per item: they share K/V
    int64_t bq          # query rows per block (heads == 1)
    int64_t n_blocks    # blocks per matrix
    int64_t n_units     # n_batch / heads head groups
    int64_t n_chunks    # key chunks per unit (> 1: split keys, merged after)
    int64_t chunk       # keys per chunk
    int64_t k0, k1      # the keys [k0, k1) any row may see (a window's), chunked
    int64_t pstride     # elements of one partial state
    int64_t n_items
    int threads


cdef inline int64_t _row_elems(int kind, int64_t d) noexcept nogil:
    """Elements (bytes, for q8_0) a kernel reads of one K or V row of d values."""
    return <int64_t>attn_q8_row_bytes(d) if kind == ATTN_F32_KVQ8 else d


cdef inline const char* _at(const attn_operand* x, int64_t b, int64_t row, size_t itemsize) noexcept nogil:
    """Element [row, 0] of matrix b of operand x."""
    return x.base + (x.offsets[b] + row * x.s_row) * <int64_t>itemsize


cdef inline int64_t _visible_end(const attn_problem* a, int64_t i) noexcept nogil:
    """One past the last key row i may see."""
    cdef int64_t end = a.n_k
    if a.causal:
        end = min(end, i + a.causal_offset + 1)
    if a.window:
        end = min(end, i + a.win_hi + 1)
    return max(<int64_t>0, end)


cdef inline int64_t _window_start(const attn_problem* a, int64_t i) noexcept nogil:
    """The first key row i may see (its window's left edge), in [0, n_k]."""
    if not a.window:
        return 0
    return max(<int64_t>0, min(a.n_k, i + a.win_lo))


cdef int64_t _shared_kv_heads(const attn_problem* a) noexcept nogil:
    """Consecutive matrices reading the same K, V (and mask) matrix: GQA's query
    heads of one key/value head, or any broadcast; 1 when runs are uneven."""
    cdef int64_t g = 1, b
    while g < a.n_batch and _same_kv(a, g, 0):
        g += 1
    if a.n_batch % g != 0:
        return 1
    for b in range(a.n_batch):
        if not _same_kv(a, b, b - b % g):
            return 1
    return g


cdef inline bint _same_kv(const attn_problem* a, int64_t b, int64_t c) noexcept nogil:
    """Whether matrices b and c read the same K, V (pages and length) and mask rows."""
    return (a.k.offsets[b] == a.k.offsets[c] and a.v.offsets[b] == a.v.offsets[c]
            and (a.mask_kind == ATTN_MASK_NONE or a.mask.offsets[b] == a.mask.offsets[c])
            and (a.pages == NULL or a.page_rows[b] == a.page_rows[c])
            and (a.kv_len == NULL or a.kv_len[b] == a.kv_len[c]))


cdef Plan _plan(const attn_problem* a, int num_threads, size_t kv_itemsize) noexcept nogil:
    """How the call is cut into items: a function of the shape only (never of
    num_threads, which only caps the threads used)."""
    cdef Plan p
    cdef int64_t g
    cdef double work = <double>a.n_batch * a.n_q * a.n_k * (a.d_k + a.d_v)
    p.heads, p.n_chunks, p.chunk, p.pstride = 1, 1, a.n_k, 0
    p.k0, p.k1 = 0, a.n_k
    p.bq = ATTN_BQ
    if a.n_q <= ATTN_SPLIT_MAX_Q and a.varlen == NULL:   # (varlen: blocks of one sequence's rows)
        # Decode: the query heads sharing a K/V head go together, so each K/V
        # row is read once per group (a row's visibility must not depend on
        # its head: one query row, or no mask and no causal; nor its scores:
        # no ALiBi, whose slope is the head's).
        if a.alibi == NULL and not (a.window and a.weights != NULL) and (a.n_q == 1 or (a.mask_kind == ATTN_MASK_NONE and not a.causal
                                                and not a.window)):
            g = _shared_kv_heads(a)
            p.heads = g
            while p.heads * a.n_q > ATTN_BQ:   # the largest divisor of g that fits a block
                p.heads -= 1
                while g % p.heads != 0:
                    p.heads -= 1
        p.bq = p.heads * a.n_q
        p.n_units = a.n_batch // p.heads
        p.n_blocks = 1
        # A window: only the keys [k0, k1) some row sees are read (decode
        # reads the last left + 1 keys), and only they are chunked.
        if a.window and a.kv_len == NULL:   # (per-matrix lengths shift each window: _item)
            p.k0 = _window_start(a, 0)
            p.k1 = max(p.k0, _visible_end(a, a.n_q - 1))
        # Keys in chunks of at least ATTN_SPLIT_MIN_KEYS, as many as the cap allows
        # (not with return_weights: the weights need each row's final m_i, l_i)
        p.n_chunks = min(<int64_t>ATTN_SPLIT_MAX_CHUNKS, max(<int64_t>1, (p.k1 - p.k0) // ATTN_SPLIT_MIN_KEYS))
        if a.weights != NULL:
            p.n_chunks = 1
        p.chunk = max(<int64_t>1, (p.k1 - p.k0 + p.n_chunks - 1) // p.n_chunks)
        p.n_chunks = max(<int64_t>1, (p.k1 - p.k0 + p.chunk - 1) // p.chunk)
        if p.n_chunks > 1:
            p.pstride = attn_part_elems(p.bq, a.d_v)
        p.n_items = p.n_units * p.n_chunks
        # a thread per ATTN_GRAIN_DECODE_BYTES of K/V read, or per
        # ATTN_GRAIN_DECODE_FMA multiply-adds, whichever gives more
        work = <double>p.n_units * (p.k1 - p.k0) * (a.d_k + a.d_v)
        p.threads = attn_threads_for(max(work * kv_itemsize / ATTN_GRAIN_DECODE_BYTES,
                                         work * p.bq / ATTN_GRAIN_DECODE_FMA), 1.0, num_threads)
    else:
        if a.causal:
            # A block crossing the diagonal computes its whole key range; smaller
            # blocks waste less (about bq / (2 n_q) of the causal work).
            if a.n_q <= 256:
                p.bq = 32
            elif a.n_q <= 1024 and p.bq > 64:
                p.bq = 64
        # A window of w keys: a block of bq rows reads bq + w - 1 keys for w
        # each row sees; blocks of at most w / ATTN_WINDOW_BLOCKS rows
        if a.window:
            while p.bq > ATTN_BQ_MIN and p.bq * ATTN_WINDOW_BLOCKS > a.win_hi - a.win_lo + 1:
                p.bq = p.bq // 2
        # Few matrices (one head, short sequence): halve the blocks until there
        # are 8 items to share out, down to ATTN_BQ_MIN rows.
        while p.bq > ATTN_BQ_MIN and a.n_batch * ((a.n_q + p.bq - 1) // p.bq) < 8:
            p.bq = p.bq // 2
        p.n_units = a.n_batch
        p.n_blocks = (a.n_q + p.bq - 1) // p.bq
        p.n_items = a.n_batch * p.n_blocks
        # a thread for every ATTN_GRAIN_FMA multiply-adds at most
        p.threads = attn_threads_for(work, ATTN_GRAIN_FMA, num_threads)
    p.threads = <int>min(<int64_t>p.threads, p.n_items)
    return p


cdef int _item(const attn_problem* a, const attn_kernels* K, const Plan* p, int64_t it,
               attn_ws* ws, char* parts, char* pack) noexcept nogil:
    """Item it: a block of query rows of one matrix, or (decode) the rows of a
    group of heads against one key chunk. (A packed variable-length batch:
    a block of one sequence's rows, with that sequence's problem.)"""
    cdef attn_problem one
    cdef int64_t b, o_rs = a.d_v
    cdef char* out
    cdef char* lse
    cdef size_t sz = attn_kind_size(a.kind)
    cdef size_t kvsz = attn_kind_kv_size(a.kind)
    cdef size_t msz = sz if a.mask_kind == ATTN_MASK_ADD else 1
    cdef size_t osz = 2 if a.out_bf16 else sz
    cdef int64_t u, blk, b0, i0, nq, c, j0, j1, jend, h, shift
    cdef char* part = NULL
    if p.n_blocks == 1:
        u, c = it // p.n_chunks, it % p.n_chunks
        b0, i0, nq = u * p.heads, 0, a.n_q
        j0 = p.k0 + c * p.chunk
        j1 = min(p.k1, j0 + p.chunk)
        if p.n_chunks > 1:
            part = parts + it * p.pstride * <int64_t>sz
    else:
        # matrix-major: consecutive items share a matrix, so its keys and
        # values stay in cache between them; under causal a matrix's longest
        # blocks (last rows) go first and its short ones fill in at the end
        b0 = it // p.n_blocks
        blk = p.n_blocks - 1 - it % p.n_blocks if a.causal else it % p.n_blocks
        i0 = blk * p.bq
        nq = min(p.bq, a.n_q - i0)
        j0, j1 = 0, a.n_k
    if a.varlen != NULL:
        # a packed sequence (one head each, no split keys: see _plan): its own
        # lengths and offsets (the plan's blocks cover the longest sequence)
        b = a.n_batch
        one = a[0]
        one.n_q, one.n_k = a.varlen[b0], a.varlen[b + b0]
        one.causal_offset += a.varlen[2 * b + b0]
        one.win_lo += a.varlen[2 * b + b0]
        one.win_hi += a.varlen[2 * b + b0]
        one.alibi_offset += a.varlen[2 * b + b0]
        a = &one
        if i0 >= a.n_q:
            return OK         # past this sequence's rows: nothing to compute
        nq = min(nq, a.n_q - i0)
        j1 = min(j1, a.n_k)
    elif a.kv_len != NULL:
        # its own key count, offsets aligned to its own last key (the heads of
        # an item share it: _same_kv)
        one = a[0]
        shift = a.kv_len[b0] - a.n_k
        one.n_k = a.kv_len[b0]
        one.causal_offset += shift
        one.win_lo += shift
        one.win_hi += shift
        one.alibi_offset += shift
        a = &one
        j1 = min(j1, a.n_k)
        j0 = min(j0, j1)
    jend = min(j1, _visible_end(a, i0 + nq - 1))   # keys past it are invisible to the block
    j0 = min(max(j0, _window_start(a, i0)), jend)  # and keys before the first row's window
    if ATTN_DEBUG_ENABLED:
        for h in range(p.heads):
            if not region_ok(&a.q, b0 + h, i0, i0 + nq, a.d_k, sz):
                return ERR_BOUNDS
        # (a q8_0 row: its values and their scales, attn_kernel.h)
        if a.pages != NULL:
            if not _pages_ok(a, b0, j0, jend):
                return ERR_BOUNDS
        elif not (region_ok(&a.k, b0, j0, jend, _row_elems(a.kind, a.d_k), kvsz)
                  and region_ok(&a.v, b0, j0, jend, _row_elems(a.kind, a.d_v), kvsz)):
            return ERR_BOUNDS
        if a.mask_kind != ATTN_MASK_NONE and not region_ok(&a.mask, b0, i0, i0 + nq, a.n_k, msz):
            return ERR_BOUNDS
    ws.k = _at(&a.k, b0, 0, kvsz)
    ws.v = _at(&a.v, b0, 0, kvsz)
    ws.mask = _at(&a.mask, b0, 0, msz) if a.mask_kind != ATTN_MASK_NONE else NULL
    ws.i0 = i0
    # several heads (one query row each, see _plan): every row sees the same
    # keys (jend) and the same mask row
    ws.m_rs = a.mask.s_row if p.heads == 1 else 0
    ws.causal = a.causal and p.heads == 1
    ws.window = a.window and p.heads == 1           # (heads: one row each, its window is [j0, jend))
    ws.alibi_slope = a.alibi[b0] if a.alibi != NULL else 0.0   # (no ALiBi with heads > 1)
    ws.sinks = a.sinks + b0 if a.sinks != NULL else NULL       # (heads: nq rows each)
    ws.sink_rows = nq
    K.begin(a, ws, p.heads * nq)
    for h in range(p.heads):
        K.load_q(a, ws, _at(&a.q, b0 + h, i0, sz), nq, h * nq)
    out = a.out + (b0 * a.n_q + i0) * a.d_v * <int64_t>osz
    lse = NULL if a.lse == NULL else a.lse + (b0 * a.n_q + i0) * <int64_t>sz
    if a.varlen != NULL:
        out = a.out + (a.varlen[3 * a.n_batch + b0] + i0 * a.out_rs) * <int64_t>osz
        o_rs = a.out_rs
        lse = NULL if a.lse == NULL else a.lse + (a.varlen[4 * a.n_batch + b0] + i0) * <int64_t>sz
    _flash_block(a, K, ws, b0, j0, jend, out, o_rs, lse, part, pack)
    if a.weights != NULL:
        _weights_pass(a, K, ws, jend, a.weights + (b0 * a.n_q + i0) * a.n_k * <int64_t>sz, sz)
    return OK


cdef attn_ws* _ws_alloc(const attn_problem* a, size_t sz, int64_t rows) noexcept nogil:
    """One thread's scratch: the attn_ws header, then its regions (attn_ws_layout),
    64-byte aligned; NULL when out of memory. Freed by attn_aligned_free."""
    cdef size_t head = (sizeof(attn_ws) + 63) & ~(<size_t>63)
    cdef int64_t bk = attn_key_tile(a, rows)   # rows: the plan's largest block (sized for its key tile)
    cdef size_t nbytes = attn_ws_layout(NULL, NULL, sz, a.d_k, a.d_v, bk)
    cdef char* base = <char*>attn_aligned_alloc(head + nbytes)
    if base == NULL:
        return NULL
    attn_ws_layout(<attn_ws*>base, base + head, sz, a.d_k, a.d_v, bk)
    return <attn_ws*>base


cdef int _attention_run(const attn_problem* a, int num_threads) noexcept nogil:
    cdef const attn_kernels* K = attn_table(a.kind)
    cdef size_t sz = attn_kind_size(a.kind)
    cdef Plan p = _plan(a, num_threads, attn_kind_kv_size(a.kind))
    cdef int64_t it, u, rows = p.heads * a.n_q
    cdef int status = OK, merged = OK
    cdef attn_ws* ws = NULL
    cdef char* parts = NULL
    cdef char* pack = NULL
    cdef size_t pack_bytes = _pack_size(a, p.heads * min(p.bq, a.n_q))   # (0: no tile copies)
    if p.n_chunks > 1:   # (a block kept for the next call: attn_kept)
        parts = <char*>attn_kept_take(attn_parts_kept(), <size_t>(p.n_items * p.pstride) * sz, ATTN_PARTS_KEEP_MAX)
        if parts == NULL:
            return ERR_NOMEM
    if p.threads <= 1:
        # one thread: no parallel region (its fork/join costs microseconds)
        ws = _ws_alloc(a, sz, p.heads * min(p.bq, a.n_q))
        pack = <char*>attn_aligned_alloc(pack_bytes) if pack_bytes > 0 else NULL
        if ws == NULL or (pack_bytes > 0 and pack == NULL):
            status = ERR_NOMEM
        else:
            for it in range(p.n_items):
                status |= _item(a, K, &p, it, ws, parts, pack)
            attn_tiles_release(a)  # (AMX: the tiles FN(begin) configured)
            for u in range(p.n_units if parts != NULL else 0):
                status |= _merge(a, K, &p, u, parts, rows, sz)
        attn_aligned_free(ws)
        attn_aligned_free(pack)
    else:
        with parallel(num_threads=p.threads):
            ws = _ws_alloc(a, sz, p.heads * min(p.bq, a.n_q))
            pack = <char*>attn_aligned_alloc(pack_bytes) if pack_bytes > 0 else NULL
            # dynamic schedule: causal blocks differ in cost
            for it in prange(p.n_items, schedule="dynamic"):
                if ws == NULL or (pack_bytes > 0 and pack == NULL):
                    status |= ERR_NOMEM  # OR-reduction of status bits
                else:
                    status |= _item(a, K, &p, it, ws, parts, pack)
            attn_tiles_release(a)
            attn_aligned_free(ws)
            attn_aligned_free(pack)
            # Split keys: merge each unit's chunks in chunk order, in the same
            # parallel region (one fork/join per call; the loop above ends with
            # a barrier). After an allocation failure this merges garbage that
            # is never returned: the caller raises.
            for u in prange(p.n_units if parts != NULL else 0, schedule="static"):
                merged |= _merge(a, K, &p, u, parts, rows, sz)   # (its own reduction variable)
    attn_kept_give(attn_parts_kept(), parts)
    return status | merged


cdef inline int _merge(const attn_problem* a, const attn_kernels* K, const Plan* p, int64_t u,
                       char* parts, int64_t rows, size_t sz) noexcept nogil:
    """Unit u's key chunks, merged in chunk order into its out rows and lse
    (a bfloat16 out: merged in float32, then rounded once)."""
    cdef int64_t n = rows * a.d_v
    cdef float* o32 = NULL
    if a.out_bf16:
        o32 = <float*>malloc(n * sizeof(float))
        if o32 == NULL:
            return ERR_NOMEM
    K.merge(parts + u * p.n_chunks * p.pstride * <int64_t>sz, p.n_chunks, rows, a.d_v,
            <char*>o32 if a.out_bf16 else a.out + u * n * <int64_t>sz, a.d_v,
            NULL if a.lse == NULL else a.lse + u * rows * <int64_t>sz,
            a.sinks + u * p.heads if a.sinks != NULL else NULL, a.n_q)   # (unit u: p.heads matrices of n_q rows)
    if a.out_bf16:
        attn_narrow_bf16(o32, <uint16_t*>a.out + u * n, n)
        free(o32)
    return OK


# --------------------------------------------------------------------------
# masked softmax: rows in parallel, each row vectorized in C

cdef int _softmax_run(const attn_operand* x, const attn_operand* mask, int mask_kind,
                      char* out, int64_t n_rows, int64_t n, size_t sz, int num_threads) noexcept nogil:
    cdef const attn_kernels* K = attn_table(ATTN_F64 if sz == 8 else ATTN_F32)
    cdef int64_t r
    cdef double work = <double>n_rows * n
    cdef int status = OK
    cdef size_t msz = sz if mask_kind == ATTN_MASK_ADD else 1
    cdef const char* mrow
    num_threads = attn_threads_for(work, ATTN_GRAIN_SOFTMAX, num_threads)
    for r in prange(n_rows, num_threads=num_threads, schedule="static"):
        mrow = NULL
        if not region_ok(x, r, 0, 1, n, sz):
            status |= ERR_BOUNDS  # OR-reduction of status bits
            continue
        if mask_kind != ATTN_MASK_NONE:
            mrow = _at(mask, r, 0, msz)
            if not region_ok(mask, r, 0, 1, n, msz):
                status |= ERR_BOUNDS
                continue
        K.softmax_row(_at(x, r, 0, sz), x.s_col, mrow, mask_kind,
                      mask.s_col if mrow != NULL else 0, out + r * n * <int64_t>sz, n)
    return status


# --------------------------------------------------------------------------
# Python-facing wrappers (validated inputs only)

cdef attn_operand operand(object arr, const int64_t* offsets, int64_t s_row, int64_t s_col):
    """The descriptor of ndarray ``arr`` (all zero for None): matrix b at
    ``offsets[b]`` elements, element strides s_row, s_col. Debug builds add
    the array's byte extent, which the kernels' reads are checked against.
    Both extensions' (attn._kernels_backward cimports it: attn/_kernels.pxd)."""
    cdef attn_operand x
    memset(&x, 0, sizeof(x))
    if arr is None:
        return x
    x.base = <const char*>cnp.PyArray_DATA(<cnp.ndarray>arr)
    x.offsets = offsets
    x.s_row = s_row
    x.s_col = s_col
    if ATTN_DEBUG_ENABLED:  # extents only matter to the debug build's checks
        lo, hi = np.lib.array_utils.byte_bounds(arr)
        x.lo = <const char*><size_t>lo
        x.hi = <const char*><size_t>hi
    return x


cdef int mask_kind(object mask):
    """The kernel's kind of a mask operand: ATTN_MASK_NONE (None), ATTN_MASK_BOOL
    (True = takes part) or ATTN_MASK_ADD (a float mask, added to the scores).
    The one place a mask's kind is decided (attn._kernels_backward cimports it)."""
    if mask is None:
        return ATTN_MASK_NONE
    return ATTN_MASK_BOOL if cnp.PyArray_TYPE(<cnp.ndarray>mask) == cnp.NPY_BOOL else ATTN_MASK_ADD


def attention(q, k, v, mask, out, weights,
              const int64_t[::1] q_off, const int64_t[::1] k_off,
              const int64_t[::1] v_off, const int64_t[::1] m_off,
              tuple q_strides, tuple k_strides, tuple v_strides, tuple m_strides,
              bint causal, int64_t causal_offset, double scale, int num_threads, lse=None,
              variants=None, varlen=None, int64_t out_rs=0, tuple dims=None, bint q_bf16=False,
              paged=None, kv_len=None):
    """Fused attention over n_batch matrices; writes ``out`` (and ``weights``, ``lse``).

    Parameters
    ----------
    q, k, v : ndarray (any strides)
        float32 or float64, all one dtype; or float32 q with float16 or
        bfloat16 (ml_dtypes) k and v (read as they are, widened in
        registers, computed in float32); or float32 q with int8 k and v
        holding q8_0 rows (attn._quantized.Q8Tensor.data viewed as int8,
        shape [..., S, row bytes], dequantized in registers). Matrix b
        of q starts ``q_off[b]`` elements after q's data pointer and has
        element strides ``q_strides`` (row, column).
    mask : ndarray of bool or of q's dtype, or None
    out : ndarray, C-contiguous [n_batch, n_q, d_v], q's dtype
        (or bfloat16 when q is float32 and there are no weights: each
        output row is then rounded once as the kernel writes it)
    weights : ndarray, C-contiguous [n_batch, n_q, n_k], q's dtype, or None
    causal, causal_offset : key j is visible to row i iff j <= i + causal_offset
    scale : float multiplying q . k
    num_threads : int >= 1
    lse : ndarray, C-contiguous [n_batch, n_q], q's dtype, or None
        Receives the log-sum-exp of each row's visible scaled scores,
        m_i + log(l_i) (-inf for a row with no visible key; NaN where the
        row's output is NaN).
    variants : tuple or None
        ``(window, win_lo, win_hi, softcap, alibi, alibi_offset, sinks)``: key j
        visible to row i only if i + win_lo <= j <= i + win_hi (when window);
        softcap > 0 caps the scaled scores; alibi, float64 [n_batch] or None,
        adds -slope |i + alibi_offset - j|; sinks, float64 [n_batch] or None,
        join each row's softmax sum: out, weights and lse include them (see
        attn_kernel.h).
    varlen : ndarray of int64, C-contiguous [5, n_batch], or None
        A packed variable-length batch (attn_kernel.h): per matrix its n_q,
        n_k, offset shift, and the element offsets of its row 0 in ``out``
        (rows ``out_rs`` apart) and in ``lse`` (rows contiguous); ``out`` and
        ``lse`` are then any C-contiguous arrays holding them, and ``dims``
        = (n_batch, largest n_q, largest n_k, d_k, d_v). No weights.
    q_bf16 : bool
        float32 ``q`` holds bfloat16 values (the caller's query was bfloat16)
        and k, v are bfloat16: the avx512-bf16 path then computes Q.K^T and
        P.V by bfloat16 dot products (P rounded to bfloat16, as torch's
        bfloat16 SDPA does). Ignored otherwise.
    paged : tuple or None
        ``(pages, page_rows, page_size, k_page, v_page)``: a paged K and V
        (attn_kernel.h; FlashAttention's block table), k and v then the page
        pools, ``k_off``/``v_off`` each matrix's offset inside a page row,
        ``dims`` given. Every table entry a matrix reads was checked by the
        caller. No weights.
    kv_len : ndarray of int64, C-contiguous [n_batch], or None
        The keys each matrix sees (its offsets aligned to its own last key),
        ``dims`` giving the largest.
    """
    cdef attn_problem a
    cdef int status
    cdef cnp.ndarray o = out
    set_variants(&a, variants)
    set_varlen(&a, varlen, out_rs)
    set_paged(&a, paged, kv_len)
    if (paged is not None or kv_len is not None) and weights is not None:
        raise ValueError("a paged K/V or per-matrix key lengths take no weights")
    a.q = operand(q, offsets_data(q_off), q_strides[0], q_strides[1])
    a.k = operand(k, offsets_data(k_off), k_strides[0], k_strides[1])
    a.v = operand(v, offsets_data(v_off), v_strides[0], v_strides[1])
    a.mask = operand(mask, offsets_data(m_off), m_strides[0], m_strides[1])
    a.mask_kind = mask_kind(mask)
    a.out = <char*>cnp.PyArray_DATA(o)
    a.weights = NULL if weights is None else <char*>cnp.PyArray_DATA(<cnp.ndarray>weights)
    a.lse = NULL if lse is None else <char*>cnp.PyArray_DATA(<cnp.ndarray>lse)
    if dims is None:
        a.n_batch = o.shape[0]
        a.n_q = o.shape[1]
        a.d_v = o.shape[2]
        a.n_k = k.shape[k.ndim - 2]
        a.d_k = q.shape[q.ndim - 1]
    else:
        a.n_batch, a.n_q, a.n_k, a.d_k, a.d_v = dims
    if out.dtype == np.float64:
        a.kind = ATTN_F64
    elif k.dtype == np.int8:    # q8_0 rows (attn._quantized: values, then scales)
        a.kind = ATTN_F32_KVQ8
        # the kernel reads attn_q8_row_bytes(d) contiguous bytes of every row
        if not (v.dtype == np.int8 and k.shape[k.ndim - 1] == <int64_t>attn_q8_row_bytes(a.d_k)
                and v.shape[v.ndim - 1] == <int64_t>attn_q8_row_bytes(a.d_v)
                and k_strides[1] == 1 and v_strides[1] == 1):
            raise ValueError(f"int8 key/value rows must be q8_0 rows of {attn_q8_row_bytes(a.d_k)} and "
                             f"{attn_q8_row_bytes(a.d_v)} contiguous bytes; got key {k.shape} {k.dtype}, "
                             f"value {v.shape} {v.dtype}")
    elif k.dtype == np.float16:
        a.kind = ATTN_F32_KV16
    else:
        a.kind = ATTN_F32_KVBF16 if _is_bfloat16(cnp.PyArray_TYPE(k)) else ATTN_F32
    a.causal = causal
    a.causal_offset = causal_offset
    a.scale = scale
    a.q_bf16 = q_bf16 and a.kind == ATTN_F32_KVBF16
    a.out_bf16 = _is_bfloat16(cnp.PyArray_TYPE(o))
    if a.out_bf16 and (a.kind == ATTN_F64 or weights is not None):
        raise ValueError("a bfloat16 out needs a float32 kind and no weights")
    with nogil:
        status = _attention_run(&a, num_threads)
    raise_status(status, "attention")


def masked_softmax(x, mask, out, const int64_t[::1] x_off, const int64_t[::1] m_off,
                   int64_t x_stride, int64_t m_stride, int num_threads):
    """Softmax of each row of ``x`` (masked) into C-contiguous ``out`` [n_rows, n]."""
    cdef attn_operand xs, ms
    cdef int status, mk = mask_kind(mask)
    cdef cnp.ndarray o = out
    cdef size_t sz = o.itemsize
    xs = operand(x, offsets_data(x_off), 0, x_stride)
    ms = operand(mask, offsets_data(m_off), 0, m_stride)
    with nogil:
        status = _softmax_run(&xs, &ms, mk, <char*>cnp.PyArray_DATA(o),
                              o.shape[0], o.shape[1], sz, num_threads)
    raise_status(status, "masked_softmax")


# --------------------------------------------------------------------------
# The per-call fast path: the common case recognized here and run from compiled code

cdef int _bf16_num = -1  # NumPy's type number of ml_dtypes.bfloat16, once ml_dtypes is imported


cdef bint _is_bfloat16(int typenum):
    """Whether ``typenum`` is ml_dtypes' bfloat16 (a user dtype: its number is given at
    registration, so it is looked up the first time an array of a user dtype comes by)."""
    global _bf16_num
    if typenum < 256:                # NPY_USERDEF: user dtypes come after the builtin ones
        return False
    if _bf16_num < 0:
        ml_dtypes = sys.modules.get("ml_dtypes")
        if ml_dtypes is None:       # no bfloat16 array can exist without it
            return False
        _bf16_num = np.dtype(ml_dtypes.bfloat16).num
    return typenum == _bf16_num


cdef int _kind_of(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v):
    """The element kind of native, aligned q, k, v, or -1 (then the caller
    validates in Python). A 16-bit q is converted by the caller."""
    cdef int tq = cnp.PyArray_TYPE(q), tk = cnp.PyArray_TYPE(k), tv = cnp.PyArray_TYPE(v)
    if not (cnp.PyArray_ISNOTSWAPPED(q) and cnp.PyArray_ISNOTSWAPPED(k) and cnp.PyArray_ISNOTSWAPPED(v)
            and cnp.PyArray_ISALIGNED(q) and cnp.PyArray_ISALIGNED(k) and cnp.PyArray_ISALIGNED(v)):
        return -1
    if tk != tv:
        return -1
    if tq == cnp.NPY_FLOAT32 and tk == cnp.NPY_FLOAT32:
        return ATTN_F32
    if tq == cnp.NPY_FLOAT64 and tk == cnp.NPY_FLOAT64:
        return ATTN_F64
    if (tq == cnp.NPY_FLOAT32 or tq == cnp.NPY_FLOAT16) and tk == cnp.NPY_FLOAT16:
        return ATTN_F32_KV16
    if (tq == cnp.NPY_FLOAT32 or tq == tk) and _is_bfloat16(tk):
        return ATTN_F32_KVBF16
    return -1


cdef bint _whole_elements(cnp.ndarray a):
    """Whether every stride of ``a`` is a whole number of elements (the kernels count
    strides and offsets in elements; attn._layout copies an operand that is not)."""
    cdef int64_t isz = cnp.PyArray_ITEMSIZE(a)
    cdef int d
    for d in range(a.ndim):
        if cnp.PyArray_STRIDES(a)[d] % isz != 0:
            return False
    return True


cdef int fill_offsets(cnp.ndarray a, const cnp.npy_intp* batch, int nbatch, int n_inner, int64_t group,
                      int64_t* out) noexcept:
    """The element offset of every inner block of ``a`` over the broadcast ``batch``
    (C order over its nbatch dims) into ``out``: the one place operand offsets
    are computed (attn._layout.describe and the fast path both call it).

    ``a``'s leading dims (all but the last n_inner) are right-aligned with
    ``batch``; each is 1 (broadcast), or equal to its batch dim, or with
    ``group > 1`` the last one times group equals its batch dim (GQA: query
    head h reads key/value head h // group). Strides in whole elements (the
    caller checks), any sign; stride 0 broadcasts. Returns 0; -1 if there are
    more batch dims than NumPy has (never, for a NumPy shape)."""
    cdef int nlead = a.ndim - n_inner, first = nbatch - nlead, d, dl
    cdef int64_t isz = cnp.PyArray_ITEMSIZE(a), n = 1, b, o = 0, new
    cdef int64_t idx[64]
    cdef int64_t step[64]
    cdef int64_t div[64]
    cdef int64_t contrib[64]
    if nbatch > 64:
        return -1
    for d in range(nbatch):
        n *= batch[d]
        idx[d] = 0
        contrib[d] = 0
        dl = d - first
        if dl >= 0 and cnp.PyArray_DIMS(a)[dl] != 1:
            step[d] = cnp.PyArray_STRIDES(a)[dl] // isz
        else:
            step[d] = 0                    # broadcast: every index reads the same block
        div[d] = group if (group > 1 and dl == nlead - 1) else 1
    for b in range(n):                     # an odometer over the batch indices
        out[b] = o
        d = nbatch - 1
        while d >= 0:
            idx[d] += 1
            if idx[d] == batch[d]:
                idx[d] = 0
            new = (idx[d] // div[d]) * step[d]
            o += new - contrib[d]
            contrib[d] = new
            if idx[d] != 0:
                break
            d -= 1
    return 0


def matrix_offsets(cnp.ndarray a, tuple batch, int n_inner, int64_t group):
    """int64 [prod(batch)]: the element offset of every inner block of ``a`` over the
    broadcast ``batch`` (see fill_offsets; attn._layout.matrix_offsets calls it)."""
    cdef int nbatch = len(batch), d
    cdef cnp.npy_intp dims[64]
    cdef int64_t n = 1
    if nbatch > 64:
        raise ValueError(f"at most 64 batch dims, got {nbatch}")
    for d in range(nbatch):
        dims[d] = batch[d]
        n *= dims[d]
    out = np.empty(n, np.int64)
    fill_offsets(a, dims, nbatch, n_inner, group, <int64_t*>cnp.PyArray_DATA(out))
    return out


cdef int _fast_mask(cnp.ndarray m, cnp.ndarray q, int nb, int kind, int64_t n_k, int64_t* offs,
                    attn_operand* r):
    """A padding mask broadcast over the query rows (shape [..., 1, S] or [S]; bool,
    or float of the compute dtype; native, aligned; leading dims 1 or q's) as
    the kernel's operand (per-matrix offsets into ``offs``): its mask kind, or
    -1 for any other mask (the caller then validates in Python). A mask with
    one row is never the inverted causal pattern the validation warns about."""
    cdef int t = cnp.PyArray_TYPE(m), md = m.ndim, lead, d, mk = mask_kind(m)
    cdef int64_t isz = cnp.PyArray_ITEMSIZE(m)
    cdef cnp.npy_intp* sh = cnp.PyArray_DIMS(m)
    cdef cnp.npy_intp* qsh = cnp.PyArray_DIMS(q)
    if mk == ATTN_MASK_ADD and not ((t == cnp.NPY_FLOAT32 and kind != ATTN_F64)
                                    or (t == cnp.NPY_FLOAT64 and kind == ATTN_F64)):
        return -1                         # a float mask not in the compute dtype (an int mask too)
    if not (cnp.PyArray_ISNOTSWAPPED(m) and cnp.PyArray_ISALIGNED(m) and _whole_elements(m)):
        return -1
    if md < 1 or sh[md - 1] != n_k or (md >= 2 and sh[md - 2] != 1):
        return -1
    lead = md - 2 if md >= 2 else 0
    if lead > nb:
        return -1
    for d in range(lead):                 # right-aligned with q's batch dims
        if sh[d] != 1 and sh[d] != qsh[nb - lead + d]:
            return -1
    fill_offsets(m, qsh, nb, 2 if md >= 2 else 1, 1, offs)
    r[0] = operand(m, offs, 0, cnp.PyArray_STRIDES(m)[md - 1] // isz)  # row stride 0: one row for all
    return mk


cdef object _decide = None   # attn._validation.decide_shapes_and_options (bind_validation)
cdef object _Q8Tensor = None # attn._quantized.Q8Tensor (bind_validation)


def bind_validation(decide, q8_tensor):
    """Give the fast path the validation's decisions and the int8 cache's type: the Python layer
    above hands them down once (attn._backends.fused, at its import), so this compiled layer
    imports nothing from the layers above it. Until then sdpa_fast declines every call."""
    global _decide, _Q8Tensor
    _decide, _Q8Tensor = decide, q8_tensor


cdef int _q8_kind(cnp.ndarray q, object key, object value):
    """ATTN_F32_KVQ8 when ``key`` and ``value`` are attn.Q8Tensor rows of q's
    head size under a native, aligned float32, float16 or bfloat16 q; else -1
    (then the caller validates in Python, which raises check_pair's errors).
    Q8Tensor's constructor guarantees uint8 rows of row_bytes(dim) contiguous
    bytes."""
    cdef int tq = cnp.PyArray_TYPE(q)
    if not (type(key) is _Q8Tensor and type(value) is _Q8Tensor):
        return -1
    if not (cnp.PyArray_ISNOTSWAPPED(q) and cnp.PyArray_ISALIGNED(q)):
        return -1
    if not (tq == cnp.NPY_FLOAT32 or tq == cnp.NPY_FLOAT16 or _is_bfloat16(tq)):
        return -1
    if q.ndim < 2 or key.dim != q.shape[q.ndim - 1]:
        return -1
    return ATTN_F32_KVQ8


def sdpa_fast(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
              return_weights, num_threads, int64_t check_memory_above):
    """scaled_dot_product_attention's common case straight to the kernel, or None.

    The common case: ndarrays of float32 / float64 (or a 16-bit key and value,
    or an int8 cache: key and value attn.Q8Tensor, see _q8_kind), native and
    aligned, strides in whole elements, without dropout or weights, no mask
    or a padding mask broadcast over the query rows (see _fast_mask), the same
    batch dims (GQA: query heads a multiple of key/value heads at dim -3),
    nothing empty. This recognizes the call and
    decides nothing of its own: the batch, GQA group, causal offset, scale and
    thread count come from attn._validation.decide_shapes_and_options (which
    raises the validation's errors), and the operand offsets from
    fill_offsets, as for every other call. Anything else returns None: the
    caller then runs the full validation.
    """
    cdef cnp.ndarray q, k, v, o, off
    cdef int kind, nd, nb, d, mk = ATTN_MASK_NONE
    cdef int64_t n_batch = 1, group
    cdef int64_t* offs
    cdef attn_problem a
    cdef int status, threads
    if type(query) is not np.ndarray or _decide is None:
        return None
    if return_weights is not False or not (type(backend) is str and (backend == "auto" or backend == "cython")):
        return None
    if not ((type(dropout_p) is float or type(dropout_p) is int) and dropout_p == 0):
        return None
    q = query
    if type(key) is np.ndarray and type(value) is np.ndarray:
        k, v = key, value
        kind = _kind_of(q, k, v)
    else:                                 # an int8 cache: its q8_0 rows [..., S, row bytes] in place
        kind = _q8_kind(q, key, value)
        if kind < 0:
            return None
        k, v = key.data, value.data
    nd = q.ndim
    if kind < 0 or nd < 2 or k.ndim != nd or v.ndim != nd:
        return None
    nb = nd - 2
    if (kind != ATTN_F32_KVQ8 and q.shape[nd - 1] != k.shape[nd - 1]) or k.shape[nd - 2] != v.shape[nd - 2]:
        return None
    for d in range(nb):                   # the same batch dims, but for GQA's heads
        if k.shape[d] != v.shape[d] or (q.shape[d] != k.shape[d] and not (enable_gqa is True and d == nb - 1)):
            return None
        n_batch *= q.shape[d]
        if n_batch > 2**40:
            return None                  # absurd broadcast shapes: the Python path
    a.n_batch, a.n_q, a.n_k = n_batch, q.shape[nd - 2], k.shape[nd - 2]
    a.d_k, a.d_v = q.shape[nd - 1], (value.dim if kind == ATTN_F32_KVQ8 else v.shape[nd - 1])
    if n_batch == 0 or a.n_q == 0 or a.n_k == 0 or a.d_k == 0 or a.d_v == 0:
        return None
    if <double>n_batch * a.n_q * a.d_v * 8 >= <double>check_memory_above:  # large: checked in Python
        return None
    if not (_whole_elements(q) and _whole_elements(k) and _whole_elements(v)):
        return None
    if attn_mask is not None and not (type(attn_mask) is np.ndarray and (is_causal is None or is_causal is False)):
        return None                      # (with is_causal: the validation's error)
    _, group, causal_offset, sc, threads = _decide(q, key, value, is_causal, scale, enable_gqa, num_threads)
    a.causal = causal_offset is not None
    a.causal_offset = causal_offset if a.causal else 0
    a.scale = sc

    out_dtype = q.dtype
    if cnp.PyArray_TYPE(q) == cnp.NPY_FLOAT16 or _is_bfloat16(cnp.PyArray_TYPE(q)):
        for d in range(nd):
            if cnp.PyArray_STRIDES(q)[d] == 0:
                return None              # broadcast: converted without expanding in Python
        # [*batch, L, E]: small next to the cache. A C-ordered copy (astype keeps the
        # input's memory order, and an overlapping view's copy is not one)
        if _is_bfloat16(cnp.PyArray_TYPE(q)) and cnp.PyArray_IS_C_CONTIGUOUS(q):
            q = cast_bf16(query, np.float32, threads)
        else:
            q = np.ascontiguousarray(q, dtype=np.float32)
    a.out_bf16 = _is_bfloat16(cnp.PyArray_TYPE(query))   # a bfloat16 out, rounded as written
    o = np.empty(query.shape[:nb] + (a.n_q, a.d_v),
                 out_dtype if a.out_bf16 else np.float64 if kind == ATTN_F64 else np.float32)
    off = np.empty(4 * n_batch, np.int64)
    offs = <int64_t*>cnp.PyArray_DATA(off)
    memset(&a.mask, 0, sizeof(a.mask))
    if attn_mask is not None:
        mk = _fast_mask(attn_mask, query, nb, kind, a.n_k, offs + 3 * n_batch, &a.mask)
        if mk < 0:
            return None
    fill_offsets(q, cnp.PyArray_DIMS(query), nb, 2, 1, offs)
    fill_offsets(k, cnp.PyArray_DIMS(query), nb, 2, group, offs + n_batch)
    fill_offsets(v, cnp.PyArray_DIMS(query), nb, 2, group, offs + 2 * n_batch)
    a.kind = kind
    a.q = _fast_operand(q, offs, nd)
    a.k = _fast_operand(k, offs + n_batch, nd)
    a.v = _fast_operand(v, offs + 2 * n_batch, nd)
    a.mask_kind = mk
    a.out = <char*>cnp.PyArray_DATA(o)
    a.weights = NULL
    a.lse = NULL
    a.q_bf16 = kind == ATTN_F32_KVBF16 and _is_bfloat16(cnp.PyArray_TYPE(query))
    set_variants(&a, None)
    with nogil:
        status = _attention_run(&a, threads)
    raise_status(status, "attention")
    return o if out_dtype == o.dtype else o.astype(out_dtype)


cdef attn_operand _fast_operand(cnp.ndarray x, const int64_t* offsets, int nd):
    cdef int64_t isz = cnp.PyArray_ITEMSIZE(x)
    return operand(x, offsets, cnp.PyArray_STRIDES(x)[nd - 2] // isz, cnp.PyArray_STRIDES(x)[nd - 1] // isz)


# --------------------------------------------------------------------------
# bfloat16 <-> float32 of contiguous arrays (ml_dtypes' astype runs about
# 1 ns an element, as long as a small attention call itself)

cdef enum:
    CAST_CHUNK = 1 << 16   # elements per work item
    CAST_GRAIN = 1 << 19   # elements per thread, at least


cdef void _narrow_bf16_run(const uint32_t* x, uint16_t* y, int64_t n, int threads) noexcept nogil:
    """y = x rounded to bfloat16 (attn_narrow_bf16: the kernel's own rule for its
    bfloat16 out, nearest even as ml_dtypes and torch round)."""
    cdef int64_t c, lo
    for c in prange((n + CAST_CHUNK - 1) // CAST_CHUNK, num_threads=threads, schedule="static"):
        lo = c * CAST_CHUNK
        attn_narrow_bf16_array(<const float*>x + lo, y + lo, min(n - lo, <int64_t>CAST_CHUNK))


cdef void _widen_bf16_run(const uint16_t* x, uint32_t* y, int64_t n, int threads) noexcept nogil:
    """y = x as float32 (exact: a bfloat16 is the top half of a float32)."""
    cdef int64_t c, i, lo, hi
    for c in prange((n + CAST_CHUNK - 1) // CAST_CHUNK, num_threads=threads, schedule="static"):
        lo = c * CAST_CHUNK
        hi = min(n, lo + CAST_CHUNK)
        for i in range(lo, hi):
            y[i] = (<uint32_t>x[i]) << 16


def cast_bf16(cnp.ndarray x, dtype, int num_threads):
    """A new C-contiguous array of ``x``'s shape and ``dtype``: C-contiguous ``x``
    converted between float32 and bfloat16, either way (the callers,
    attn._dtypes.cast and the fast path, check the kinds)."""
    cdef cnp.ndarray out = np.empty((<object>x).shape, dtype)
    cdef int64_t n = cnp.PyArray_SIZE(x)
    cdef int threads = attn_threads_for(<double>n, CAST_GRAIN, num_threads)
    cdef void* src = cnp.PyArray_DATA(x)
    cdef void* dst = cnp.PyArray_DATA(out)
    if cnp.PyArray_ITEMSIZE(x) == 4:
        with nogil:
            _narrow_bf16_run(<const uint32_t*>src, <uint16_t*>dst, n, threads)
    else:
        with nogil:
            _widen_bf16_run(<const uint16_t*>src, <uint32_t*>dst, n, threads)
    return out


cdef extern from "attn_fma_peak.h" nogil:
    double attn_fma_peak(int path, int dtype, int64_t iters)


def fma_peak(str dtype, int64_t iters, int threads):
    """GFLOP/s of multiply-add chains on the current SIMD path (attn/_src/attn_fma_peak.h), or 0.

    ``dtype``: "f32", "f64" or "bf16" (vdpbf16ps products; avx512-bf16 and amx paths only, else 0).
    ``iters`` rounds on each of ``threads`` threads, all at once; the wall time of the whole
    (a benchmark's yardstick: call it with ~0.05 s of work, take the best of a few).
    """
    cdef int code = {"f32": 0, "f64": 1, "bf16": 2}.get(dtype, -1)
    cdef int path = attn_simd_path_id, t
    cdef double flops = 0.0
    if code < 0:
        raise ValueError(f"dtype must be 'f32', 'f64' or 'bf16', got {dtype!r}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    t0 = time.perf_counter()
    for t in prange(threads, nogil=True, num_threads=threads, schedule="static"):
        flops += attn_fma_peak(path, code, iters)   # one round each, a sum reduction
    seconds = time.perf_counter() - t0
    return flops / seconds / 1e9 if flops > 0 else 0.0


def max_threads():
    """OpenMP's default thread count (OMP_NUM_THREADS, or all cores)."""
    return attn_omp_max_threads()


def simd_paths():
    """Instruction-set paths this CPU can run, widest (the default) first."""
    cdef const char* names[8]
    cdef int i, n = attn_simd_available(names, 8)
    return [names[i].decode("ascii") for i in range(n)]


def _select_simd(str name):
    """Switch the kernels, forward and backward, to another available path (for
    tests); returns the previous one. Not thread-safe against kernels running
    concurrently."""
    previous = attn_simd_path().decode("ascii")
    if attn_simd_select(name.encode("ascii")) != 0:
        raise ValueError(f"SIMD path {name!r} not available; this CPU has {simd_paths()}")
    return previous


def q8_rounds_query(int64_t n_q, int64_t d_k):
    """Whether a call of n_q query rows per head and head size d_k over a q8_0
    (int8) K rounds its scaled query to q8_0 on the current path (a decode
    call on a path with VNNI; not attn.varlen_attention's packed batches):
    attn/_src/attn_simd_q8dot.h, docs/kv_cache_int8.md."""
    cdef attn_problem a
    memset(&a, 0, sizeof(a))
    a.kind, a.n_q, a.d_k, a.varlen = ATTN_F32_KVQ8, n_q, d_k, NULL
    return bool(attn_q8_rounds_query(&a))


def build_info():
    """What this build of the kernels has: OpenMP, its thread count, debug checks."""
    return {
        "openmp": bool(ATTN_HAVE_OPENMP),
        "max_threads": attn_omp_max_threads(),
        "debug": bool(ATTN_DEBUG_ENABLED),
        "simd": attn_simd_path().decode("ascii"),
    }
