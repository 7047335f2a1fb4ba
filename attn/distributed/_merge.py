"""Merging partial attention results by their log-sum-exp.

A query row's attention over keys split into blocks a and b: each block gives
its normalized output ``o`` and log-sum-exp ``l`` (-inf when the row sees no
key of the block); the row's output over both is

    l = logaddexp(l_a, l_b),  o = exp(l_a - l) o_a + exp(l_b - l) o_b

the merge the fused kernel does across threads when it splits the keys
(``attn/_kernels.pyx``, "Split keys"), here across ranks. A row that sees no
key in either block keeps output 0 and lse -inf.
"""

import numpy as np


def merge_into(acc_out, acc_lse, out, lse):
    """``(acc_out, acc_lse) <- merge((acc_out, acc_lse), (out, lse))``, in place.

    acc_out, out : [..., L, Ev];  acc_lse, lse : [..., L] (same dtype).
    """
    new = np.logaddexp(acc_lse, lse)
    seen = new > -np.inf
    with np.errstate(invalid="ignore"):  # -inf - -inf for rows that saw nothing yet
        w_acc = np.where(seen, np.exp(acc_lse - new), 0.0).astype(acc_out.dtype, copy=False)
        w_new = np.where(seen, np.exp(lse - new), 0.0).astype(acc_out.dtype, copy=False)
    acc_out *= w_acc[..., None]
    acc_out += w_new[..., None] * out
    acc_lse[...] = new
