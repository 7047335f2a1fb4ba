"""The effective number of attended keys: ``1 / sum(w**2)`` per row."""

import numpy as np

from ._validation import validate_effective_keys


def effective_keys(weights, axis=-1):
    """How many keys a row of attention weights really attends to.

    The inverse participation ratio ``1 / sum_j w_j**2`` (the seed article's
    "effective number of terms"): ``n`` for uniform weights over ``n`` keys,
    1 for a one-hot row.

    Parameters
    ----------
    weights : array_like of float, shape [..., n_k]
        Attention weights; each slice along ``axis`` should sum to 1.
    axis : int, default -1
        The key axis.

    Returns
    -------
    ndarray of float, ``weights``' shape without ``axis`` (a 0-d array for a
    single row). A row of all zeros (every key masked) gives 0, not inf.

    Examples
    --------
    >>> import numpy as np, attn
    >>> attn.effective_keys(np.full(4, 0.25))
    array(4.)
    >>> attn.effective_keys(np.array([[1.0, 0.0], [0.5, 0.5]]))
    array([1., 2.])
    """
    w, axis = validate_effective_keys(weights, axis)
    total = np.sum(np.square(w), axis=axis)  # [...] without the key axis
    return np.divide(1.0, total, out=np.zeros_like(total), where=total != 0)
