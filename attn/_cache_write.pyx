# New keys and values into a paged cache: row t of K_new / V_new goes to row
# ``row[t]`` of page ``block[t]``, in one compiled call for both (a serving
# engine's cache update every layer and step: attn.integrations' vLLM backend).
# The values are copied as they are (bytes: any dtype, the caller's views
# decide what they mean), each head's E elements by one memcpy where both
# sides hold them contiguously. Shapes and dtypes are checked before the
# nogil block, every (block, row) pair inside it before anything is copied:
# a slot outside the pool raises after it, nothing written.

from libc.stdint cimport int64_t
from libc.string cimport memcpy

cimport numpy as cnp
import numpy as np

cnp.import_array()


cdef int64_t _first_outside(const int64_t* block, const int64_t* row, int64_t n_tokens, int64_t n_pages,
                            int64_t page_size) noexcept nogil:
    """The first token whose (block, row) is outside the pool, or -1."""
    cdef int64_t t
    for t in range(n_tokens):
        if block[t] < 0 or block[t] >= n_pages or row[t] < 0 or row[t] >= page_size:
            return t
    return -1


cdef void _copy_rows(const char* src, const cnp.npy_intp* src_st, char* dst, const cnp.npy_intp* dst_st,
                     const int64_t* block, const int64_t* row, int64_t n_tokens, int64_t n_heads,
                     int64_t n_elem, int64_t itemsize) noexcept nogil:
    """src [T, H_kv, E] -> dst [P, page, H_kv, E] at (block[t], row[t]) (checked); byte strides."""
    cdef int64_t t, h, e
    cdef const char* s
    cdef char* d
    cdef bint rows_whole = src_st[2] == itemsize and dst_st[3] == itemsize
    for t in range(n_tokens):
        for h in range(n_heads):
            s = src + t * src_st[0] + h * src_st[1]
            d = dst + block[t] * dst_st[0] + row[t] * dst_st[1] + h * dst_st[2]
            if rows_whole:
                memcpy(d, s, n_elem * itemsize)
            else:
                for e in range(n_elem):
                    memcpy(d + e * dst_st[3], s + e * src_st[2], itemsize)


cdef void _check(cnp.ndarray new, cnp.ndarray pages, str new_name, str pages_name, int64_t n_tokens) except *:
    """``new`` [>= n_tokens, H_kv, E] fits ``pages`` [P, page, H_kv, E] (same dtype, writeable)."""
    if new.ndim != 3 or pages.ndim != 4 or new.shape[1] != pages.shape[2] or new.shape[2] != pages.shape[3]:
        raise ValueError(f"{new_name} [T, H_kv, E] does not fit {pages_name} [num_pages, page_size, H_kv, E]: "
                         f"{new_name} {(<object>new).shape}, {pages_name} {(<object>pages).shape}")
    if new.shape[0] < n_tokens:
        raise ValueError(f"{new_name} has {new.shape[0]} rows for {n_tokens} tokens")
    if new.dtype != pages.dtype:
        raise TypeError(f"{new_name} ({new.dtype}) and {pages_name} ({pages.dtype}) must have one dtype")
    if not pages.flags.writeable:
        raise ValueError(f"{pages_name} is read-only")


def write_pages(cnp.ndarray k_new, cnp.ndarray v_new, cnp.ndarray k_pages, cnp.ndarray v_pages,
                const int64_t[::1] block, const int64_t[::1] row):
    """Row t of ``k_new`` and ``v_new`` into row ``row[t]`` of page ``block[t]`` of ``k_pages`` and
    ``v_pages``, for t < len(block).

    Parameters
    ----------
    k_new, v_new : ndarray, shape [>= T, H_kv, E] and [>= T, H_kv, Ev], any strides
    k_pages, v_pages : ndarray, shape [num_pages, page_size, H_kv, E] / [.., Ev], any strides
        (a view of a larger cache tensor: vLLM's [num_blocks, H_kv, page, 2E]); each one
        dtype with its new rows (the bytes are copied as they are).
    block, row : ndarray of int64, shape [T], C-contiguous
        Page and row of each token: 0 <= block < num_pages, 0 <= row < page_size.

    Raises
    ------
    ValueError, TypeError
        Shapes or dtypes that do not fit, read-only pages, or a (block, row) outside the pool
        (then nothing is written).
    """
    cdef int64_t n = block.shape[0], bad
    if row.shape[0] != n:
        raise ValueError(f"block ({n}) and row ({row.shape[0]}) must have one length")
    _check(k_new, k_pages, "k_new", "k_pages", n)
    _check(v_new, v_pages, "v_new", "v_pages", n)
    if k_pages.shape[0] != v_pages.shape[0] or k_pages.shape[1] != v_pages.shape[1]:
        raise ValueError(f"k_pages {(<object>k_pages).shape} and v_pages {(<object>v_pages).shape} must have one "
                         f"pool of pages")
    if n == 0:
        return
    cdef const char* ks = <const char*>cnp.PyArray_DATA(k_new)
    cdef const char* vs = <const char*>cnp.PyArray_DATA(v_new)
    cdef char* kd = <char*>cnp.PyArray_DATA(k_pages)
    cdef char* vd = <char*>cnp.PyArray_DATA(v_pages)
    cdef const cnp.npy_intp* ks_st = cnp.PyArray_STRIDES(k_new)
    cdef const cnp.npy_intp* vs_st = cnp.PyArray_STRIDES(v_new)
    cdef const cnp.npy_intp* kd_st = cnp.PyArray_STRIDES(k_pages)
    cdef const cnp.npy_intp* vd_st = cnp.PyArray_STRIDES(v_pages)
    cdef int64_t heads_k = k_new.shape[1], heads_v = v_new.shape[1], e_k = k_new.shape[2], e_v = v_new.shape[2]
    cdef int64_t item_k = cnp.PyArray_ITEMSIZE(k_new), item_v = cnp.PyArray_ITEMSIZE(v_new)
    cdef int64_t n_pages = k_pages.shape[0], page_size = k_pages.shape[1]
    with nogil:
        bad = _first_outside(&block[0], &row[0], n, n_pages, page_size)
        if bad < 0:
            _copy_rows(ks, ks_st, kd, kd_st, &block[0], &row[0], n, heads_k, e_k, item_k)
            _copy_rows(vs, vs_st, vd, vd_st, &block[0], &row[0], n, heads_v, e_v, item_v)
    if bad >= 0:
        raise ValueError(f"token {bad}: page {block[bad]}, row {row[bad]} is outside the pool of {n_pages} pages of "
                         f"{page_size} rows (nothing written)")
