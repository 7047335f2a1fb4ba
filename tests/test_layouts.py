"""Any memory layout gives the same result (and the cython backend reads it in place)."""

import numpy as np
import pytest

import attn
from _bounds import assert_sdpa_close, unit_roundoff
from _layouts import SAME_VALUES, layouts
from conftest import BACKENDS, random_bool_mask, torch_sdpa


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["q", "k", "v", "mask"])
def test_layouts_match_torch(backend, which, rng, tmp_path):
    q = rng.standard_normal((2, 3, 9, 8))
    k = rng.standard_normal((2, 3, 11, 8))
    v = rng.standard_normal((2, 3, 11, 5))
    mask = random_bool_mask(rng, (2, 3, 9, 11))
    ref = torch_sdpa(q, k, v, attn_mask=mask)
    args = dict(q=q, k=k, v=v, mask=mask)
    for name, (arr,) in layouts((args[which],), SAME_VALUES + ("memmap",), tmp_path):
        args2 = dict(args, **{which: arr})
        out = attn.scaled_dot_product_attention(
            args2["q"], args2["k"], args2["v"], attn_mask=args2["mask"], backend=backend
        )
        assert_sdpa_close(out, ref, q, k, v, attn_mask=mask, what=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcast_inputs_stride_zero(backend, rng):
    q = rng.standard_normal((1, 9, 8))
    k = rng.standard_normal((11, 8))
    v = rng.standard_normal((11, 4))
    qb = np.broadcast_to(q, (4, 9, 8))  # stride 0 over the batch
    kb = np.broadcast_to(k, (4, 11, 8))
    vb = np.broadcast_to(v, (4, 11, 4))
    mask = np.broadcast_to(random_bool_mask(rng, (9, 11)), (4, 9, 11))
    out = attn.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, backend=backend)
    ref = torch_sdpa(np.array(qb), np.array(kb), np.array(vb), attn_mask=np.array(mask))
    assert_sdpa_close(out, ref, qb, kb, vb, attn_mask=mask)


def test_float_mask_of_other_float_dtype(rng):
    q = rng.standard_normal((5, 4)).astype(np.float32)
    mask = rng.standard_normal((5, 5))  # float64 mask with float32 inputs
    out = attn.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert out.dtype == np.float32
    # the float64 mask may be converted to float32 (the working dtype): an error of u32 |mask| per score
    ref = torch_sdpa(*(q.astype(np.float64),) * 3, attn_mask=mask)
    assert_sdpa_close(out, ref, q, q, q, attn_mask=mask, dmask=unit_roundoff(np.float32) * np.abs(mask))
