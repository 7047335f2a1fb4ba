# The fused attention kernel: FlashAttention-2's forward pass (Dao, 2023,
# Algorithm 1) on the CPU, and the masked softmax.
#
# Layering: attn's Python side validates every argument and describes each
# operand (base pointer, per-matrix offsets, strides); attn._problem.build
# turns the validated call into one attn_problem (attn/_src/attn_kernel.h,
# shared with C); the `def` functions at the end of this file call it and run
# the `noexcept nogil` cores, which never touch a Python object and return
# status bits raised after the nogil block.
#
# What is where (the compiled layer, by role):
#   _problem.pyx            the one problem builder (element and mask kinds,
#                           variants, operand offsets), every entry point's
#   this file               the algorithm (_flash_block), the work plan
#                           (_plan), the thread pool (_attention_run), the
#                           entry points attention and masked_softmax, the
#                           SIMD path's choice
#   _fast_path.pyx          the common call recognized in compiled code
#                           (sdpa_fast), fed to the same builder
#   _kernels_backward.pyx   the backward (FlashAttention-2)
#   _casts.pyx              bfloat16 <-> float32 of whole arrays
#   _blas_callback.pyx      OpenBLAS's parallel jobs on this module's OpenMP team
#   _kernels_testing.pyx    the tests' hook: the SIMD path switched in-process
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
#   _src/attn_omp.h         OpenMP or not, the debug build's switch
#   _src/attn_fork.h        a forked child's parallel regions on a master thread of its own
#   _src/attn_blas_pool.h   OpenBLAS's jobs on attn's OpenMP team (_blas_callback.pyx)
#
# Directives (setup.py): boundscheck/wraparound/initializedcheck are off in a
# normal build and on in the debug build (ATTN_DEBUG_BUILD=1), which also
# defines ATTN_DEBUG so every region a micro-kernel reads is checked against
# its array first.

from libc.stdint cimport int64_t, uint16_t, uint32_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset
from posix.unistd cimport usleep
from cython.parallel cimport parallel, prange

cimport numpy as cnp

import numpy as np

from attn._attn_kernel cimport *  # what the compiled modules share with C (see that file)
from attn._problem cimport build, mask_kind, operand

cnp.import_array()

# A forked child's parallel regions run on a master thread of the child's own
# (attn/_src/attn_fork.h): libgomp's pool does not survive fork().
cdef extern from "attn_fork.h" nogil:
    ctypedef int (*attn_fork_job)(void* arg) noexcept nogil
    int attn_fork_register()
    int attn_fork_threads(int threads)
    int attn_fork_run(attn_fork_job fn, void* arg, int threads)
    void attn_fork_refuse_master()
    int attn_fork_in_child

if attn_fork_register() != 0:
    raise ImportError("attn._kernels: pthread_atfork failed (cannot make the kernels fork-safe)")

cdef extern from "attn_simd.h" nogil:
    ctypedef struct attn_vpairs:
        uint32_t* rows
        int64_t p0, hi, cap
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
        const int32_t* pages
        int64_t kv_end
        int64_t v_pf_end
        attn_vpairs* vpairs
        const void* kwide
        const void* vwide
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
        void (*heads_tile)(const attn_problem*, attn_ws*, int64_t, int64_t, int64_t, int64_t, int64_t) noexcept nogil
        void (*widen_rows)(const void*, int64_t, int64_t, int64_t, void*, int64_t) noexcept nogil
    size_t attn_ws_layout(attn_ws* ws, char* base, size_t itemsize, int64_t d_k, int64_t d_v, int64_t bk)
    int64_t attn_part_elems(int64_t nq, int64_t d_v)
    const attn_kernels* attn_table(int kind)
    void attn_simd_init()
    const char* attn_simd_path()
    int attn_simd_available(const char** names, int n)
    int attn_simd_select(const char* name)
    int attn_simd_select_vbmi(int on)
    int attn_e4m3_tables()
    ctypedef struct attn_simd_cap:
        const char* name
        int path
    const attn_simd_cap attn_simd_caps[]
    int attn_simd_path_id
    void attn_tiles_release(const attn_problem* a)
    int64_t attn_key_tile(const attn_problem* a, int64_t nq)
    int attn_amx_block(const attn_problem* a, int64_t nq)
    int attn_q8_rounds_query(const attn_problem* a)
    int ATTN_DOT_MAX_Q
    int ATTN_VL_MAX
    const char* attn_paged_row(const attn_problem* a, const int32_t* pages, const char* base,
                               int64_t page_elems, int64_t s_row, int64_t j)
    int64_t attn_paged_run(const attn_problem* a, int64_t j)
    double attn_tile_softmax_rounds(int64_t iters)

attn_simd_init()  # pick the instruction-set path once, before any kernel runs


cdef int simd_path_id() noexcept nogil:
    """The instruction-set path the kernels run (ATTN_PATH_* of attn_dispatch.h).
    attn._kernels_backward cimports it (attn/_kernels.pxd) and runs the same
    path: one choice, at this module's import, and one switch (select_simd)."""
    return attn_simd_path_id


cdef int select_simd(const char* name) noexcept nogil:
    """Switch the kernels, forward and backward, to the path ``name`` if this CPU runs it:
    0 = done, -1 = not available (attn_dispatch.h). Not while a kernel runs; its one caller
    is the tests' hook, attn._kernels_testing.select_simd."""
    return attn_simd_select(name)


cdef int select_vbmi(int on) noexcept nogil:
    """Whether an e4m3 cache takes AVX512_VBMI's tables on the avx512-bf16 and avx512-amx
    paths (attn_dispatch.h): the previous setting, -1 where the CPU has none. The tests'
    hook (attn._kernels_testing.select_vbmi) runs the other widening on such a CPU too."""
    return attn_simd_select_vbmi(on)


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
                       _Pack* pack) noexcept nogil:
    """Rows of ws (Q_i of matrix b, after K.begin and K.load_q) against keys [j0, j1):
    writes out rows (stride o_rs) and lse, or the partial state (m_i, l_i, O_i) into ``part``."""
    cdef attn_problem packed
    cdef const attn_problem* t = _tiles_start(a, ws, b, j1, &pack, &packed)
    cdef int64_t kb = j0
    while kb < j1:
        kb += _tile(a, t, K, ws, b, kb, j1, pack)
    _tiles_end(a, K, ws, out, o_rs, lse, part)


cdef const attn_problem* _tiles_start(const attn_problem* a, attn_ws* ws, int64_t b, int64_t j1,
                                      _Pack** pack, attn_problem* packed) noexcept nogil:
    """Before the first tile of ws's block (matrix b, keys below j1): the problem its
    micro-kernels read K, V rows through. A paged K/V: a block of at most ATTN_DOT_MAX_Q
    rows (decode) reads the pages in place, its micro-kernels following the page list
    (attn_ws.pages; *pack becomes NULL); a larger block, with *pack (pages shorter than a
    tile or strided rows, see _pack_rows), reads each tile's rows from the thread's copy of
    its matrix's keys (_pack_keys; ``packed``: the rows of a contiguous cache), so its tiles
    are those of a contiguous cache; otherwise its tiles end where their page does (_page_in)."""
    cdef int64_t kvsz = <int64_t>attn_kind_kv_size(a.kind)
    ws.pages = NULL
    ws.kv_end = j1
    ws.v_pf_end = 0
    ws.kwide = ws.vwide = NULL
    if pack[0] != NULL and pack[0].wide and ws.nq <= ATTN_DOT_MAX_Q:
        pack[0] = NULL   # (a widened copy serves the register tiles: decode rows read K/V as stored)
    if a.pages != NULL and ws.nq <= ATTN_DOT_MAX_Q and a.k.s_col == 1 and a.v.s_col == 1:
        ws.pages = a.pages + a.page_rows[b]
        ws.k = a.k.base + a.k.offsets[b] * kvsz
        ws.v = a.v.base + a.v.offsets[b] * kvsz
        pack[0] = NULL
    if pack[0] == NULL:
        return a
    packed[0] = a[0]
    packed.k.s_row, packed.k.s_col = _row_elems(a.kind, a.d_k), 1
    packed.v.s_row, packed.v.s_col = _row_elems(a.kind, a.d_v), 1
    return packed


cdef inline int64_t _tile(const attn_problem* a, const attn_problem* t, const attn_kernels* K,
                          attn_ws* ws, int64_t b, int64_t kb, int64_t j1, _Pack* pack) noexcept nogil:
    """One FlashAttention-2 step of ws's block: the key tile from kb (attn_key_tile's keys,
    fewer at j1 or, read through _page_in, at its page's end); its key count.
    (The tiles depend on a, kb and j1 alone: every head of a _flash_heads item gets the same.)"""
    cdef int64_t nk = min(attn_key_tile(a, ws.nq), j1 - kb)
    if pack != NULL:
        _pack_keys(a, K, ws, b, kb, nk, pack)
    elif a.pages != NULL and ws.pages == NULL:
        nk = _page_in(a, ws, b, kb, nk)
    K.scores(t, ws, kb, nk)        # S = Q_i K_j^T (+ mask); invisible -> -inf
    K.online_softmax(ws, nk)       # m_new = max(m_i, rowmax S); alpha = exp(m_i - m_new)
                                   # P = exp(S - m_new); l_i = alpha l_i + rowsum P; m_i = m_new
    K.pv(t, ws, kb, nk)            # O_i = diag(alpha) O_i + P V_j
    return nk


cdef inline void _tiles_end(const attn_problem* a, const attn_kernels* K, attn_ws* ws, char* out,
                            int64_t o_rs, char* lse, char* part) noexcept nogil:
    """After the last tile: the partial state into ``part``, or the block's out rows and lse."""
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


cdef struct _Pack:
    # One thread's copy of a matrix's key rows [p0, p1) (K's rows at k, V's at v, each
    # contiguous, key j at row j - p0), for blocks of more rows than decode's over pages
    # shorter than a key tile or strided rows (_pack_rows): consecutive items of a thread read the same matrix
    # (matrix-major, _item), or another query head of its K/V, so each key is copied
    # once per thread rather than once per block and tile. Within one call only.
    char* k
    char* v
    int64_t cap           # rows each side holds
    int64_t p0, p1
    int64_t k_off, v_off, page_row   # whose keys: matrix b's (as _same_kv; page_row -1: not paged), p1 = p0 when none
    attn_vpairs vpairs    # V's rows of [p0, p1) as the AMX tiles read them, packed as tiles first read them
                          # (rows NULL: blocks not on AMX tiles, which pack no pairs)
    bint wide             # the rows widened to float32 (_pack_wide), d + ATTN_VL_MAX apart, as the
                          # register tiles' kpack and vpack: attn_ws.kwide, vwide (else as stored)


cdef inline size_t _wide_row_bytes(const attn_problem* a) noexcept nogil:
    """Bytes of one key's K and V rows in a widened copy (float32, each row ATTN_VL_MAX longer)."""
    return (a.d_k + a.d_v + 2 * ATTN_VL_MAX) * sizeof(float)


cdef bint _pack_wide(const attn_problem* a) noexcept nogil:
    """Whether a thread's copy of the keys (_Pack) holds them widened to float32: a float16 K/V
    (ATTN_F32_KV16, whose register tiles widen every tile they read: FN(pack_tile)) whose matrices'
    keys fit in ATTN_PACK_WIDE_MAX_BYTES so (a debug build's copy holds fewer, ATTN_PACK_MAX_BYTES,
    so that it starts afresh mid-matrix). Each key is then widened once per thread, where each block
    of rows (and each of its tiles) widened its own: FN(pack_tile) took 10 % of a float16 prefill
    (2 x 1024 causal, H32/8 E128, pages of 128)."""
    return a.kind == ATTN_F32_KV16 and <size_t>a.n_k * _wide_row_bytes(a) <= ATTN_PACK_WIDE_MAX_BYTES


cdef size_t _pack_rows(const attn_problem* a, int64_t rows) noexcept nogil:
    """Key rows of one thread's copy (_Pack) of K/V, 0 when tiles are read in place: a matrix's keys,
    up to ATTN_PACK_MAX_BYTES, and at least a key tile, for blocks of more than ATTN_DOT_MAX_Q rows
    (decode reads in place: _page_in, attn_ws.pages) over rows contiguous in themselves (s_col 1)
    where K's or V's rows are not contiguous with each other: pages shorter than a key tile, or,
    over more keys than a tile, rows further apart than their length (FlashAttention's [.., S,
    H_kv, E], its pages [n_pages, page, H_kv, E], a transposed [B, S, H, E] view: each head's rows
    H_kv E elements apart; a paged prefill over such pages of a whole tile read in place took
    1.31x the contiguous call's time, 2 x 1024 causal H32/8 E128 float32, pages of 256). On an
    Intel Xeon (family 6 model 167, 2 threads) the copy took 0.80-0.85x the in-place reads' time
    in float32 (prefill 2 x 1024 causal H32/8 E128 packed [S, H_kv, E], flash_attn_func on [1, T,
    8, E] at T = 1024 dense and causal, T = 4096), 0.81x in bfloat16, 0.955x in float16; with one
    tile of keys or fewer (T = 128) it gained nothing (1.03x) and is not made. A float16 K/V whose
    matrices fit widened (_pack_wide) gets a widened copy in any layout over more keys than a tile,
    and over pages shorter than a tile whatever its keys (tiles cut at every page end would change
    the sums' order: the bits of the contiguous call are kept)."""
    cdef int64_t bk = attn_key_tile(a, rows)
    cdef int64_t k_row = _row_elems(a.kind, a.d_k), v_row = _row_elems(a.kind, a.d_v)
    cdef size_t row_bytes = (k_row + v_row) * attn_kind_kv_size(a.kind)
    cdef bint strided = a.k.s_row != k_row or a.v.s_row != v_row
    if a.k.s_col != 1 or a.v.s_col != 1 or rows <= ATTN_DOT_MAX_Q or a.weights != NULL:
        return 0   # (return_weights: _weights_pass recomputes the scores from the rows in place)
    if _pack_wide(a):   # (over more keys than a tile, or pages shorter than one, as below)
        if a.n_k <= bk and not (a.pages != NULL and a.page_size < bk):
            return 0
        row_bytes = _wide_row_bytes(a)
    elif not ((a.pages != NULL and a.page_size < bk) or (strided and a.n_k > bk)):
        return 0
    return <size_t>max(bk, min(a.n_k, <int64_t>(ATTN_PACK_MAX_BYTES // row_bytes)))


cdef _Pack* _pack_alloc(const attn_problem* a, size_t rows, bint pairs) noexcept nogil:
    """A thread's _Pack of ``rows`` key rows (its header, then K's rows, then V's, then with
    ``pairs`` room for V's pairs of as many keys, 64-byte aligned), holding no keys; NULL when
    out of memory. Freed by attn_aligned_free."""
    cdef size_t head = (sizeof(_Pack) + 63) & ~(<size_t>63)
    cdef bint wide = _pack_wide(a)
    cdef size_t kvsz = sizeof(float) if wide else attn_kind_kv_size(a.kind)
    cdef size_t k_row = a.d_k + ATTN_VL_MAX if wide else _row_elems(a.kind, a.d_k)
    cdef size_t v_row = a.d_v + ATTN_VL_MAX if wide else _row_elems(a.kind, a.d_v)
    cdef size_t kbytes = (rows * k_row * kvsz + 63) & ~(<size_t>63)
    cdef size_t vbytes = (rows * v_row * kvsz + 63) & ~(<size_t>63)
    cdef size_t pbytes = (rows + 1) // 2 * <size_t>(a.d_v + 16) * sizeof(uint32_t) if pairs else 0
    cdef _Pack* pk = <_Pack*>attn_aligned_alloc(head + kbytes + vbytes + pbytes)
    if pk == NULL:
        return NULL
    pk.k = <char*>pk + head
    pk.v = pk.k + kbytes
    pk.cap, pk.p0, pk.p1 = <int64_t>rows, 0, 0
    pk.k_off, pk.v_off, pk.page_row = -1, -1, -1
    pk.wide = wide
    pk.vpairs.rows = <uint32_t*>(pk.v + vbytes) if pairs else NULL
    pk.vpairs.p0, pk.vpairs.hi, pk.vpairs.cap = 0, 0, <int64_t>rows
    return pk


cdef void _pack_keys(const attn_problem* a, const attn_kernels* K, attn_ws* ws, int64_t b, int64_t kb,
                     int64_t nk, _Pack* pk) noexcept nogil:
    """Point ws.k, ws.v at pk's copy of matrix b's keys, so that row kb is key kb's, after
    copying keys [kb, kb + nk) from their pages (or strided rows) where pk does not hold them
    yet: appended to its rows when they follow them and fit, else as its only rows. A wide
    copy widens them (K.widen_rows, run by run of a page's rows) and is ws.kwide, ws.vwide too."""
    cdef int64_t kvsz = <int64_t>attn_kind_kv_size(a.kind)
    cdef int64_t kbytes = _row_elems(a.kind, a.d_k) * kvsz, vbytes = _row_elems(a.kind, a.d_v) * kvsz
    cdef int64_t j, n, j1 = kb + nk
    cdef int64_t page_row = a.page_rows[b] if a.pages != NULL else -1
    cdef _PageRows src
    cdef bint same = (pk.k_off == a.k.offsets[b] and pk.v_off == a.v.offsets[b] and pk.page_row == page_row)
    if not (same and pk.p0 <= kb and kb <= pk.p1 and j1 - pk.p0 <= pk.cap):
        pk.k_off, pk.v_off, pk.page_row = a.k.offsets[b], a.v.offsets[b], page_row
        pk.p0 = pk.p1 = kb
        pk.vpairs.p0 = pk.vpairs.hi = kb
    if pk.wide:
        kbytes = (a.d_k + ATTN_VL_MAX) * <int64_t>sizeof(float)
        vbytes = (a.d_v + ATTN_VL_MAX) * <int64_t>sizeof(float)
        j = pk.p1
        while j < j1:   # (a run: rows s_row apart within one page, or to a matrix's end)
            _page_rows_at(a, b, j, &src)
            n = min(src.left, j1 - j)
            K.widen_rows(src.k, a.k.s_row, n, a.d_k, pk.k + (j - pk.p0) * kbytes, a.d_k + ATTN_VL_MAX)
            K.widen_rows(src.v, a.v.s_row, n, a.d_v, pk.v + (j - pk.p0) * vbytes, a.d_v + ATTN_VL_MAX)
            j += n
        pk.p1 = max(pk.p1, j1)
        ws.k = pk.k - pk.p0 * kbytes
        ws.v = pk.v - pk.p0 * vbytes
        ws.kwide, ws.vwide = ws.k, ws.v
        return
    if j1 > pk.p1:
        _page_rows_at(a, b, pk.p1, &src)
        for j in range(pk.p1 - pk.p0, j1 - pk.p0):
            memcpy(pk.k + j * kbytes, src.k, kbytes)
            memcpy(pk.v + j * vbytes, src.v, vbytes)
            if j + 1 < j1 - pk.p0:
                _page_rows_next(a, b, &src)
        pk.p1 = j1
    ws.k = pk.k - pk.p0 * kbytes
    ws.v = pk.v - pk.p0 * vbytes
    ws.vpairs = &pk.vpairs if pk.vpairs.rows != NULL else NULL


cdef struct _PageRows:
    # a walk over key rows of one matrix's pages (or its one run of rows, not paged): K's and V's row at ``key``,
    # and the rows left in its page (the block table is read once per page)
    int64_t key, left
    const char* k
    const char* v


cdef inline void _page_rows_at(const attn_problem* a, int64_t b, int64_t key, _PageRows* c) noexcept nogil:
    """Point c at key row ``key`` of matrix b (a K/V that is not paged: one run of rows to its end)."""
    cdef int64_t kvsz = <int64_t>attn_kind_kv_size(a.kind)
    cdef const int32_t* pages
    if a.pages == NULL:
        c.key, c.left = key, a.n_k - key
        c.k, c.v = _at(&a.k, b, key, kvsz), _at(&a.v, b, key, kvsz)
        return
    pages = a.pages + a.page_rows[b]
    c.key, c.left = key, attn_paged_run(a, key)
    c.k = attn_paged_row(a, pages, a.k.base + a.k.offsets[b] * kvsz, a.k_page, a.k.s_row, key)
    c.v = attn_paged_row(a, pages, a.v.base + a.v.offsets[b] * kvsz, a.v_page, a.v.s_row, key)


cdef inline void _page_rows_next(const attn_problem* a, int64_t b, _PageRows* c) noexcept nogil:
    """Step c to the next key row (into the next page at a page's end)."""
    cdef int64_t kvsz = <int64_t>attn_kind_kv_size(a.kind)
    c.left -= 1
    if c.left == 0:
        _page_rows_at(a, b, c.key + 1, c)
    else:
        c.key += 1
        c.k += a.k.s_row * kvsz
        c.v += a.v.s_row * kvsz


cdef bint _pages_ok(const attn_problem* a, int64_t b, int64_t j0, int64_t j1) noexcept nogil:
    """Debug builds: every page row of keys [j0, j1) of matrix b (K's and V's values,
    and a q8_0 row's scales) lies inside the cache arrays."""
    cdef int64_t j = j0, n
    cdef int64_t kvsz = <int64_t>attn_kind_kv_size(a.kind)
    cdef int64_t kw = _row_elems(a.kind, a.d_k), vw = _row_elems(a.kind, a.d_v)
    cdef const int32_t* pages = a.pages + a.page_rows[b]
    cdef const char* kp
    cdef const char* vp
    while j < j1:
        n = min(j1 - j, attn_paged_run(a, j))
        kp = attn_paged_row(a, pages, a.k.base + a.k.offsets[b] * kvsz, a.k_page, a.k.s_row, j)
        vp = attn_paged_row(a, pages, a.v.base + a.v.offsets[b] * kvsz, a.v_page, a.v.s_row, j)
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
    int64_t span        # units per item (decode): K/V heads side by side in a row (_kv_span)
    int64_t n_items
    size_t ws_bytes     # one scratch (_ws_bytes), a thread has p.span of them
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
    p.heads, p.n_chunks, p.chunk, p.pstride, p.span = 1, 1, a.n_k, 0, 1
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
        # Keys in chunks of ATTN_SPLIT_KEYS, or smaller (down to ATTN_SPLIT_MIN_KEYS)
        # until the units' chunks make ATTN_SPLIT_ITEMS items, at most the cap
        # (not with return_weights: the weights need each row's final m_i, l_i)
        p.n_chunks = min(<int64_t>ATTN_SPLIT_MAX_CHUNKS,
                         max(<int64_t>1, (p.k1 - p.k0) // ATTN_SPLIT_KEYS,
                             min((p.k1 - p.k0) // ATTN_SPLIT_MIN_KEYS,
                                 (ATTN_SPLIT_ITEMS + p.n_units - 1) // max(p.n_units, <int64_t>1))))
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
        # The units whose K/V rows lie side by side go in one item, keeping an
        # item per thread (the span only orders reads: each unit's sums are the
        # same). float32/float64 K/V only: a 16-bit cache's batch (docs/kernel.md)
        # ran 1.02-1.03x slower so, so it stays head by head. (Not on AMX tiles.)
        if a.weights == NULL and not attn_amx_block(a, p.bq):
            p.span = _kv_span(a, p.heads, p.n_units)
            while p.span > 1 and (p.n_units // p.span * p.n_chunks < p.threads or p.n_units % p.span != 0):
                p.span -= 1
            p.n_items = p.n_units // p.span * p.n_chunks
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
        # a thread for every ATTN_GRAIN_FMA multiply-adds at most, float64's
        # counted twice (a vector holds half as many: the grain is a time)
        p.threads = attn_threads_for(work * attn_kind_size(a.kind) / 4, ATTN_GRAIN_FMA, num_threads)
    p.threads = <int>min(<int64_t>p.threads, p.n_items)
    p.ws_bytes = _ws_bytes(a, attn_kind_size(a.kind), p.heads * min(p.bq, a.n_q))
    return p


cdef int64_t _kv_span(const attn_problem* a, int64_t heads, int64_t n_units) noexcept nogil:
    """Decode: how many consecutive units (``heads`` matrices sharing a K/V head each) have
    their K and V rows side by side in one row of the cache, as the K/V heads of one batch
    element in FlashAttention's [.., S, H_kv, E] layout, paged or not: the same rows, each
    unit's one row of values further on (_next_head). At most ATTN_SPAN_MAX, a divisor of
    n_units; 1 when there are none."""
    cdef int64_t g = 1, u
    if a.k.s_col != 1 or a.v.s_col != 1:
        return 1
    while g < n_units and g < ATTN_SPAN_MAX and _next_head(a, (g - 1) * heads, g * heads):
        g += 1
    while n_units % g != 0:
        g -= 1
    for u in range(n_units):
        if u % g != 0 and not _next_head(a, (u - 1) * heads, u * heads):
            return 1
    return g


cdef inline bint _next_head(const attn_problem* a, int64_t b, int64_t c) noexcept nogil:
    """Whether matrix c's K and V rows are matrix b's, one row of values further on
    (the same pages and length)."""
    return (a.k.offsets[c] - a.k.offsets[b] == _row_elems(a.kind, a.d_k)
            and a.v.offsets[c] - a.v.offsets[b] == _row_elems(a.kind, a.d_v)
            and (a.pages == NULL or a.page_rows[b] == a.page_rows[c])
            and (a.kv_len == NULL or a.kv_len[b] == a.kv_len[c]))


# The tests' hook (attn._kernels_testing.delay_items): microseconds each item (and each
# matrix the backward packs) waits before it runs, on the region's first thread [0] and
# on the others [1], so that a test can hold one thread's item while the others finish
# theirs (which a missing barrier then shows). Both 0 outside the tests.
cdef int test_delays[2]


cdef void test_delay() noexcept nogil:
    """Wait this thread's test_delays microseconds."""
    cdef int us = test_delays[0 if attn_omp_thread_num() == 0 else 1]
    if us > 0:
        usleep(us)


cdef void set_test_delays(int first_us, int others_us) noexcept nogil:
    test_delays[0], test_delays[1] = first_us, others_us


cdef int _item(const attn_problem* a, const attn_kernels* K, const Plan* p, int64_t it,
               attn_ws* ws, char* parts, _Pack* pack) noexcept nogil:
    """Item it: a block of query rows of one matrix, or (decode) the rows of a
    group of heads against one key chunk, for each of the p.span units whose K/V
    rows lie side by side (_kv_span). (A packed variable-length batch: a block of
    one sequence's rows, with that sequence's problem.) ws: the thread's p.span
    scratch regions (_ws_alloc)."""
    cdef attn_problem one
    cdef int64_t b, o_rs
    cdef char* out
    cdef char* lse
    cdef size_t sz = attn_kind_size(a.kind)
    cdef int64_t u = 0, c = 0, blk, b0, i0, nq, j0, j1, jend, s, shift
    cdef int status
    cdef char* part = NULL
    if test_delays[0] or test_delays[1]:
        test_delay()
    if p.n_blocks == 1:
        # chunk-major: consecutive items read the same keys of other units, so
        # a cache laid out [.., S, H_kv, E] (FlashAttention's, the pages) is read
        # a few whole key rows at a time; the partial states stay unit-major
        # (u, c), as _merge reads them
        c, u = it // (p.n_units // p.span), it % (p.n_units // p.span) * p.span
        b0, i0, nq = u * p.heads, 0, a.n_q
        j0 = p.k0 + c * p.chunk
        j1 = min(p.k1, j0 + p.chunk)
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
        # an item share it: _same_kv, and the units of a span: _next_head)
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
    for s in range(p.span):
        status = _block_begin(a, K, p, _ws_at(ws, p, s), b0 + s * p.heads, i0, nq, j0, jend)
        if status != OK:
            return status
    if p.span > 1:
        _flash_heads(a, K, p, ws, u, c, j0, jend, parts, pack)
        return OK
    out = _block_out(a, b0, i0, &o_rs, &lse)
    if p.n_chunks > 1:
        part = parts + (u * p.n_chunks + c) * p.pstride * <int64_t>sz
    _flash_block(a, K, ws, b0, j0, jend, out, o_rs, lse, part, pack)
    if a.weights != NULL:
        _weights_pass(a, K, ws, jend, a.weights + (b0 * a.n_q + i0) * a.n_k * <int64_t>sz, sz)
    return OK


cdef int _block_begin(const attn_problem* a, const attn_kernels* K, const Plan* p, attn_ws* ws,
                      int64_t b0, int64_t i0, int64_t nq, int64_t j0, int64_t jend) noexcept nogil:
    """ws's block: rows [i0, i0 + nq) of the p.heads matrices from b0 (K/V of b0), keys
    [j0, jend); its state begun (m_i = -inf, l_i = 0, O_i = 0) and its Q_i loaded.
    Debug builds first check every region the block reads (ERR_BOUNDS)."""
    cdef size_t sz = attn_kind_size(a.kind)
    cdef size_t kvsz = attn_kind_kv_size(a.kind)
    cdef size_t msz = sz if a.mask_kind == ATTN_MASK_ADD else 1
    cdef int64_t h
    if ATTN_DEBUG_ENABLED:
        for h in range(p.heads):
            if not region_ok(&a.q, b0 + h, i0, i0 + nq, a.d_k, 2 if a.q_raw16 else sz):
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
        K.load_q(a, ws, _at(&a.q, b0 + h, i0, 2 if a.q_raw16 else sz), nq, h * nq)
    return OK


cdef inline char* _block_out(const attn_problem* a, int64_t b0, int64_t i0, int64_t* o_rs,
                             char** lse) noexcept nogil:
    """Where the block of matrix b0 from row i0 writes: its first out row (returned; rows
    *o_rs elements apart) and lse (NULL: none)."""
    cdef size_t sz = attn_kind_size(a.kind)
    cdef size_t osz = 2 if a.out16 else sz
    if a.varlen != NULL:
        o_rs[0] = a.out_rs
        lse[0] = NULL if a.lse == NULL else a.lse + (a.varlen[4 * a.n_batch + b0] + i0) * <int64_t>sz
        return a.out + (a.varlen[3 * a.n_batch + b0] + i0 * a.out_rs) * <int64_t>osz
    o_rs[0] = a.d_v
    lse[0] = NULL if a.lse == NULL else a.lse + (b0 * a.n_q + i0) * <int64_t>sz
    return a.out + (b0 * a.n_q + i0) * a.d_v * <int64_t>osz


cdef void _flash_heads(const attn_problem* a, const attn_kernels* K, const Plan* p, attn_ws* ws,
                       int64_t u, int64_t c, int64_t j0, int64_t j1, char* parts,
                       _Pack* pack) noexcept nogil:
    """A decode item over the p.span units from u, whose K/V rows lie side by side
    (_kv_span), each begun in its own scratch (_ws_at(ws, p, s)), against chunk c's keys
    [j0, j1): key tiles outermost, units innermost, so the thread reads each tile's rows
    whole while they are in cache (blocks of <= ATTN_DOT_MAX_Q rows reading the rows in
    place: K.heads_tile, in address order). Each unit's steps are those of _flash_block
    (the same tiles, in the same order), so its sums, and their bits, are too."""
    cdef attn_problem packed
    cdef const attn_problem* t = a
    cdef _Pack* pk
    cdef char* out
    cdef char* lse
    cdef char* part = NULL
    cdef int64_t s, b, kb = j0, nk = 0, o_rs
    cdef size_t sz = attn_kind_size(a.kind)
    for s in range(p.span):
        pk = pack      # (every unit makes the same choice: it depends on a and nq alone)
        t = _tiles_start(a, _ws_at(ws, p, s), (u + s) * p.heads, j1, &pk, &packed)
    if ws.nq <= ATTN_DOT_MAX_Q and pk == NULL and (a.pages == NULL or ws.pages != NULL):
        # rows layout, K/V rows read in place: each tile's products a few keys
        # of every unit at a time, so the rows are read whole, in address order
        while kb < j1:
            nk = min(attn_key_tile(a, ws.nq), j1 - kb)
            K.heads_tile(t, ws, p.ws_bytes, p.span, kb, nk, j1)
            kb += nk
    while kb < j1:
        for s in range(p.span):
            nk = _tile(a, t, K, _ws_at(ws, p, s), (u + s) * p.heads, kb, j1, pk)
        kb += nk
    for s in range(p.span):
        b = (u + s) * p.heads
        out = _block_out(a, b, 0, &o_rs, &lse)
        if p.n_chunks > 1:
            part = parts + ((u + s) * p.n_chunks + c) * p.pstride * <int64_t>sz
        _tiles_end(a, K, _ws_at(ws, p, s), out, o_rs, lse, part)


cdef inline attn_ws* _ws_at(attn_ws* ws, const Plan* p, int64_t s) noexcept nogil:
    """A thread's scratch for unit s of its item (_ws_alloc: p.span of them)."""
    return <attn_ws*>(<char*>ws + s * <int64_t>p.ws_bytes)


cdef size_t _ws_bytes(const attn_problem* a, size_t sz, int64_t rows) noexcept nogil:
    """Bytes of one scratch (the attn_ws header, then its regions) for blocks of up to
    ``rows`` rows (sized for their key tile), a multiple of 64."""
    cdef size_t head = (sizeof(attn_ws) + 63) & ~(<size_t>63)
    cdef size_t nbytes = attn_ws_layout(NULL, NULL, sz, a.d_k, a.d_v, attn_key_tile(a, rows))
    return head + ((nbytes + 63) & ~(<size_t>63))


cdef attn_ws* _ws_alloc(const attn_problem* a, const Plan* p) noexcept nogil:
    """One thread's scratch: p.span of them, p.ws_bytes apart, each the attn_ws header,
    then its regions (attn_ws_layout), 64-byte aligned; NULL when out of memory. Freed
    by attn_aligned_free."""
    cdef size_t head = (sizeof(attn_ws) + 63) & ~(<size_t>63)
    cdef int64_t bk = attn_key_tile(a, p.heads * min(p.bq, a.n_q))   # the plan's largest block's key tile
    cdef size_t sz = attn_kind_size(a.kind)
    cdef char* base = <char*>attn_aligned_alloc(p.span * p.ws_bytes)
    cdef int64_t s
    if base == NULL:
        return NULL
    for s in range(p.span):
        attn_ws_layout(_ws_at(<attn_ws*>base, p, s), <char*>_ws_at(<attn_ws*>base, p, s) + head,
                       sz, a.d_k, a.d_v, bk)
    return <attn_ws*>base




# --------------------------------------------------------------------------
# the thread pool: a call's items as a queue any thread takes from (dynamic, one
# item at a time); two calls' queues in one region overlap them

cdef struct _Queue:
    # One call's items, taken one at a time by any thread of the region
    const attn_problem* a
    const attn_kernels* K
    Plan p
    char* parts         # its split-key partial states (NULL: none)
    size_t pack_rows    # rows of its tile copies (0: none)
    bint pack_pairs     # the copies hold V's pairs too (its blocks run on AMX tiles: attn_vpairs)
    int64_t next        # its first item no thread has taken (attn_take)


cdef int _queue_begin(_Queue* q, const attn_problem* a, int num_threads) noexcept nogil:
    """q over call a (its plan as _attention_run's); ERR_NOMEM when its partial states
    cannot be allocated."""
    q.a, q.K = a, attn_table(a.kind)
    q.p = _plan(a, num_threads, attn_kind_kv_size(a.kind))
    cdef int64_t rows = q.p.heads * min(q.p.bq, a.n_q)   # (the plan's largest block)
    q.pack_rows = _pack_rows(a, rows)
    q.pack_pairs = attn_amx_block(a, rows)
    q.next = 0
    q.parts = NULL
    if q.p.n_chunks > 1:
        q.parts = <char*>attn_kept_take(attn_parts_kept(), <size_t>(q.p.n_units * q.p.n_chunks * q.p.pstride)
                                        * attn_kind_size(a.kind), ATTN_PARTS_KEEP_MAX)
        if q.parts == NULL:
            return ERR_NOMEM
    return OK


cdef int _queue_drain(_Queue* q) noexcept nogil:
    """Run q's items until every one is taken (this thread's share: any thread may take any).
    Its scratch is allocated only once it has taken an item."""
    cdef int status = OK
    cdef int64_t it = attn_take(&q.next)
    cdef attn_ws* ws
    cdef _Pack* pack
    if it >= q.p.n_items:
        return OK
    ws = _ws_alloc(q.a, &q.p)
    pack = _pack_alloc(q.a, q.pack_rows, q.pack_pairs) if q.pack_rows > 0 else NULL
    if ws == NULL or (q.pack_rows > 0 and pack == NULL):
        status = ERR_NOMEM
    else:
        while it < q.p.n_items:
            status |= _item(q.a, q.K, &q.p, it, ws, q.parts, pack)
            it = attn_take(&q.next)
    attn_tiles_release(q.a)
    attn_aligned_free(ws)
    attn_aligned_free(pack)
    return status


cdef int _attention_run(const attn_problem* a, int num_threads) noexcept nogil:
    """Call a: its items on up to its plan's threads, then its key chunks' merges."""
    cdef _Queue q
    cdef int status = _queue_begin(&q, a, num_threads)
    if status != OK:
        return status
    return _run_queues(&q, 1, q.p.threads)


cdef int _run_queues(_Queue* qs, int n, int threads) noexcept nogil:
    """Every item of the n (1 or 2) queues, then every split-key merge, on ``threads``
    threads; gives the queues' partial states back. One thread: no parallel region (its
    fork/join costs microseconds). Several: one region (one fork/join per call), thread t
    draining queue t % n first, then the others in turn. After an allocation failure
    the merges read garbage that is never returned: the caller raises."""
    cdef int status = OK, merged = OK, first, i
    cdef int64_t t, u, units = 0
    for i in range(n):
        units += qs[i].p.n_units if qs[i].parts != NULL else 0
    if threads <= 1:
        for i in range(n):
            status |= _queue_drain(&qs[i])
        for u in range(units):
            status |= _merge_at(qs, n, u)
    else:
        with parallel(num_threads=threads):
            # one iteration a thread (a smaller team: a thread finds the items taken)
            for t in prange(threads, schedule="static", chunksize=1):
                first = <int>(t % n)
                for i in range(n):
                    status |= _queue_drain(&qs[(first + i) % n])   # OR-reduction of status bits
            # the merges read every chunk's state: once every item is done (a
            # prange here has no barrier of its own: attn_omp_barrier)
            if units > 0:
                attn_omp_barrier()
            for u in prange(units, schedule="static"):
                merged |= _merge_at(qs, n, u)   # (its own reduction variable)
    for i in range(n):
        attn_kept_give(attn_parts_kept(), qs[i].parts)
    return status | merged


cdef inline int _merge_at(_Queue* qs, int n, int64_t u) noexcept nogil:
    """Merge number u of the n queues' split-key merges (queue 0's units, then queue 1's)."""
    cdef int i = 0
    cdef int64_t units = qs[0].p.n_units if qs[0].parts != NULL else 0
    while u >= units and i + 1 < n:
        u -= units
        i += 1
        units = qs[i].p.n_units if qs[i].parts != NULL else 0
    return _merge(qs[i].a, qs[i].K, &qs[i].p, u, qs[i].parts, qs[i].p.heads * qs[i].a.n_q,
                  attn_kind_size(qs[i].a.kind))


cdef int _attention_run_overlapped(const attn_problem* a, const attn_problem* b,
                                   int num_threads) noexcept nogil:
    """Calls a and b (writing disjoint outputs) in one parallel region: a mixed batch's
    decode rows (a: K/V streamed from memory, a few flops a byte) and its prefill chunks
    (b: a few hundred flops a byte, K/V in cache). Run one after the other, each call's
    threads all wait on the same resource: memory, then the FMA units. Here even threads
    start on a's items and odd ones on b's, each turning to the other call's when its
    own are all taken (_run_queues), so a's reads overlap b's products (one core of a
    2-core Zen 4 reads at the 2-core bandwidth). Which thread runs an item never changes
    what the item computes, and each call's key chunks are merged in chunk order after
    both, so out holds the bits of the two calls run apart."""
    cdef _Queue qs[2]
    cdef int status = _queue_begin(&qs[0], a, num_threads)
    if status == OK:
        status = _queue_begin(&qs[1], b, num_threads)
    if status != OK:
        attn_kept_give(attn_parts_kept(), qs[0].parts)
        return status
    return _run_queues(qs, 2, max(qs[0].p.threads, qs[1].p.threads))


cdef inline int _merge(const attn_problem* a, const attn_kernels* K, const Plan* p, int64_t u,
                       char* parts, int64_t rows, size_t sz) noexcept nogil:
    """Unit u's key chunks, merged in chunk order into its out rows and lse
    (a 16-bit out: merged in float32, then rounded once)."""
    cdef int64_t n = rows * a.d_v
    cdef float* o32 = NULL
    if a.out16:
        o32 = <float*>malloc(n * sizeof(float))
        if o32 == NULL:
            return ERR_NOMEM
    K.merge(parts + u * p.n_chunks * p.pstride * <int64_t>sz, p.n_chunks, rows, a.d_v,
            <char*>o32 if a.out16 else a.out + u * n * <int64_t>sz, a.d_v,
            NULL if a.lse == NULL else a.lse + u * rows * <int64_t>sz,
            a.sinks + u * p.heads if a.sinks != NULL else NULL, a.n_q)   # (unit u: p.heads matrices of n_q rows)
    if a.out16:
        attn_narrow16(o32, <uint16_t*>a.out + u * n, n, a.out16)
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

cdef double tile_softmax_rounds(int64_t iters) noexcept nogil:
    """iters rounds of the current path's float32 tile softmax on the calling thread, in L1
    (attn_tile_softmax_rounds, attn_simd.h): the benchmark's softmax yardstick. Returns the
    scores done."""
    return attn_tile_softmax_rounds(iters)


cdef int fork_threads(int num_threads) noexcept nogil:
    """The threads a call may use: num_threads, or 1 in a forked child where no master
    thread could be created (attn_fork.h; attn._threads warns once)."""
    return attn_fork_threads(num_threads)


cdef void refuse_fork_master() noexcept nogil:
    """The tests' hook (attn._kernels_testing): in a forked child whose master thread has not
    started, act as if it could not be created (attn_fork.h's single-threaded fallback)."""
    attn_fork_refuse_master()


cdef int run_parallel(parallel_job job, void* arg, int num_threads) noexcept nogil:
    """job(arg), whose parallel regions use at most num_threads (from fork_threads): here,
    or on the forked child's master thread (attn_fork.h). Returns job's status."""
    return attn_fork_run(<attn_fork_job>job, arg, num_threads)


cdef struct _AttentionCall:
    const attn_problem* a
    int threads


cdef int _attention_job(void* arg) noexcept nogil:
    cdef _AttentionCall* c = <_AttentionCall*>arg
    return _attention_run(c.a, c.threads)


cdef int run_attention(const attn_problem* a, int num_threads) except -1:
    """Run the built problem ``a`` (attn._problem.build) on at most num_threads
    threads, raising the status after the nogil block (attn._fast_path cimports it)."""
    cdef int status
    cdef _AttentionCall c
    with nogil:
        c.a = a
        c.threads = fork_threads(num_threads)
        status = run_parallel(_attention_job, &c, c.threads)
    return raise_status(status, "attention")


def attention(q, k, v, mask, out, weights,
              const int64_t[::1] q_off, const int64_t[::1] k_off,
              const int64_t[::1] v_off, const int64_t[::1] m_off,
              tuple q_strides, tuple k_strides, tuple v_strides, tuple m_strides,
              causal_offset, double scale, int num_threads, lse=None,
              variants=None, varlen=None, int64_t out_rs=0, tuple dims=None, bint q_bf16=False,
              paged=None, kv_len=None):
    """Fused attention over n_batch matrices; writes ``out`` (and ``weights``, ``lse``).

    The problem is built by :func:`attn._problem.build` (its docstring has
    every argument's meaning); here in short:

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
    causal_offset : None, or key j is visible to row i iff j <= i + causal_offset
    scale : float multiplying q . k
    num_threads : int >= 1
    lse : ndarray, C-contiguous [n_batch, n_q], q's dtype, or None
        Receives the log-sum-exp of each row's visible scaled scores,
        m_i + log(l_i) (-inf for a row with no visible key; NaN where the
        row's output is NaN).
    variants : attn._variants.Variants or None
        Window, softcap, ALiBi slopes and sinks (joined to each row's sum:
        out, weights and lse include them), as validated (attn_kernel.h).
    varlen, out_rs, dims : a packed variable-length batch (C-contiguous
        int64 [5, n_batch], attn_kernel.h), its out row stride, and then
        ``dims`` = (n_batch, largest n_q, largest n_k, d_k, d_v). No weights.
    q_bf16 : bool
        The caller's query was bfloat16 and k, v are bfloat16: the
        avx512-bf16 paths then compute Q.K^T and P.V by bfloat16 dot
        products (P rounded to bfloat16, as torch's bfloat16 SDPA does).
    paged : tuple or None
        ``(pages, page_rows, page_size, k_page, v_page)``: a paged K and V
        (FlashAttention's block table), k and v then the page pools,
        ``k_off``/``v_off`` each matrix's offset inside a page row, ``dims``
        given. Every table entry a matrix reads was checked by the caller.
    kv_len : ndarray of int64, C-contiguous [n_batch], or None
        The keys each matrix sees (its offsets aligned to its own last key),
        ``dims`` giving the largest.
    """
    cdef attn_problem a
    cdef list keep = []     # arrays the problem points into, alive until the kernel returns
    _build_call(&a, keep, q, k, v, mask, out, weights, q_off, k_off, v_off, m_off, q_strides, k_strides,
                v_strides, m_strides, causal_offset, scale, lse, variants, varlen, out_rs, dims, q_bf16, paged,
                kv_len)
    run_attention(&a, num_threads)


cdef int _build_call(attn_problem* a, list keep, q, k, v, mask, out, weights,
                     const int64_t[::1] q_off, const int64_t[::1] k_off,
                     const int64_t[::1] v_off, const int64_t[::1] m_off,
                     tuple q_strides, tuple k_strides, tuple v_strides, tuple m_strides,
                     causal_offset, double scale, lse, variants, varlen, int64_t out_rs, tuple dims,
                     bint q_bf16, paged, kv_len) except -1:
    """attention's problem, built into ``a`` (the arrays it points into kept alive in ``keep``)."""
    cdef int64_t n_batch, n_q, n_k, d_k, d_v
    if dims is None:
        n_batch, n_q, d_v = out.shape[0], out.shape[1], out.shape[2]
        n_k, d_k = k.shape[k.ndim - 2], q.shape[q.ndim - 1]
    else:
        n_batch, n_q, n_k, d_k, d_v = dims
    return build(a, q, k, v, mask,
                 operand(q, offsets_data(q_off), q_strides[0], q_strides[1]),
                 operand(k, offsets_data(k_off), k_strides[0], k_strides[1]),
                 operand(v, offsets_data(v_off), v_strides[0], v_strides[1]),
                 operand(mask, offsets_data(m_off), m_strides[0], m_strides[1]),
                 out, weights, lse, n_batch, n_q, n_k, d_k, d_v, causal_offset, scale, variants, True, keep,
                 q_bf16, varlen, out_rs, paged, kv_len)


cdef int _build_args(attn_problem* a, list keep, tuple args) except -1:
    """_build_call with attention's arguments from q to kv_len as one tuple."""
    (q, k, v, mask, out, weights, q_off, k_off, v_off, m_off, q_strides, k_strides, v_strides, m_strides,
     causal_offset, scale, lse, variants, varlen, out_rs, dims, q_bf16, paged, kv_len) = args
    return _build_call(a, keep, q, k, v, mask, out, weights, q_off, k_off, v_off, m_off, q_strides, k_strides,
                       v_strides, m_strides, causal_offset, scale, lse, variants, varlen, out_rs, dims, q_bf16,
                       paged, kv_len)


cdef struct _OverlappedCall:
    const attn_problem* a
    const attn_problem* b
    int threads


cdef int _overlapped_job(void* arg) noexcept nogil:
    cdef _OverlappedCall* c = <_OverlappedCall*>arg
    return _attention_run_overlapped(c.a, c.b, c.threads)


def attention_overlapped(tuple first, tuple second, int num_threads):
    """Two calls of :func:`attention` whose outputs do not overlap, run in one parallel region
    (_attention_run_overlapped): ``first`` reading from memory (a mixed batch's decode rows),
    ``second`` computing (its prefill chunks). Each is the tuple of attention's arguments
    from q to kv_len, all given, in order, without num_threads; both are built (and checked)
    before either runs. The outputs are bit for bit those of the two calls."""
    cdef attn_problem a, b
    cdef list keep = []
    cdef int status
    cdef _OverlappedCall c
    if len(first) != 24 or len(second) != 24:
        raise TypeError(f"attention_overlapped takes two tuples of attention's 24 arguments from q to kv_len; "
                        f"got {len(first)} and {len(second)} items")
    _build_args(&a, keep, first)
    _build_args(&b, keep, second)
    with nogil:
        c.a, c.b = &a, &b
        c.threads = fork_threads(num_threads)
        status = run_parallel(_overlapped_job, &c, c.threads)
    raise_status(status, "attention")


cdef struct _SoftmaxCall:
    const attn_operand* x
    const attn_operand* mask
    int mask_kind
    char* out
    int64_t n_rows, n
    size_t sz
    int threads


cdef int _softmax_job(void* arg) noexcept nogil:
    cdef _SoftmaxCall* c = <_SoftmaxCall*>arg
    return _softmax_run(c.x, c.mask, c.mask_kind, c.out, c.n_rows, c.n, c.sz, c.threads)


def masked_softmax(x, mask, out, const int64_t[::1] x_off, const int64_t[::1] m_off,
                   int64_t x_stride, int64_t m_stride, int num_threads):
    """Softmax of each row of ``x`` (masked) into C-contiguous ``out`` [n_rows, n]."""
    cdef attn_operand xs, ms
    cdef int status
    cdef cnp.ndarray o = out
    cdef _SoftmaxCall c
    xs = operand(x, offsets_data(x_off), 0, x_stride)
    ms = operand(mask, offsets_data(m_off), 0, m_stride)
    c.x, c.mask, c.mask_kind = &xs, &ms, mask_kind(mask)
    c.out, c.n_rows, c.n, c.sz = <char*>cnp.PyArray_DATA(o), o.shape[0], o.shape[1], o.itemsize
    with nogil:
        c.threads = fork_threads(num_threads)
        status = run_parallel(_softmax_job, &c, c.threads)
    raise_status(status, "masked_softmax")


def fork_state():
    """(whether this process is a fork() child of one that loaded attn, the threads a call
    of ``max_threads()`` threads may use there: attn_fork.h); attn._threads asks it."""
    return bool(attn_fork_in_child), attn_fork_threads(attn_omp_max_threads())


def max_threads():
    """OpenMP's default thread count (OMP_NUM_THREADS, or all cores)."""
    return attn_omp_max_threads()


def simd_caps():
    """The values ATTN_SIMD takes (attn/_src/attn_dispatch.h's list), each capping the path chosen."""
    cdef int i = 0
    caps = []
    while attn_simd_caps[i].name != NULL:
        caps.append(attn_simd_caps[i].name.decode("ascii"))
        i += 1
    return caps


def simd_paths():
    """Instruction-set paths this CPU can run, widest (the default) first."""
    cdef const char* names[8]
    cdef int i, n = attn_simd_available(names, 8)
    return [names[i].decode("ascii") for i in range(n)]


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
        "e4m3_tables": bool(attn_e4m3_tables()),
    }
