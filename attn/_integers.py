"""Integer arguments: one check for every public entry point.

Each error names the argument, so a caller learns which one is wrong:
``TypeError`` for a value that is not an integer (``bool`` and ``numpy.bool_``
are refused: ``True`` is an int to Python, never a length), ``ValueError``
for one outside its range.
"""

import numbers

import numpy as np


def check_int(x, name, minimum=None, maximum=None, *, allow_none=False):
    """``x`` as an ``int``, or a TypeError/ValueError naming ``name``.

    Parameters
    ----------
    x : object
        The value given.
    name : str
        The argument's name, for the messages.
    minimum, maximum : int, optional
        Inclusive bounds (None: unbounded on that side).
    allow_none : bool
        Whether None is accepted (and returned as None).

    Returns
    -------
    int or None
        ``int(x)``: any ``numbers.Integral`` (NumPy integers included) as a Python int.

    Raises
    ------
    TypeError
        ``x`` is not an integer (or None, when allowed).
    ValueError
        ``x`` is below ``minimum`` or above ``maximum``.
    """
    if x is None and allow_none:
        return None
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int{' or None' if allow_none else ''}, got {x!r}")
    low = minimum is not None and x < minimum
    high = maximum is not None and x > maximum
    if low or high:
        if minimum is not None and maximum is not None:
            raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {x}")
        raise ValueError(f"{name} must be {'>= ' + str(minimum) if low else '<= ' + str(maximum)}, got {x}")
    return int(x)


def normalize_axis(axis, ndim, name, of):
    """``axis`` as a non-negative index among ``ndim`` dims, or a TypeError/ValueError.

    Parameters
    ----------
    axis : int
        The axis given (negative counts from the end).
    ndim : int
        How many dims the array has.
    name : str
        The argument's name (``"axis"``, ``"dim"``).
    of : str
        What the axis indexes, for the message (``"weights with shape (2, 3)"``).

    Returns
    -------
    int
        ``axis % ndim``.
    """
    axis = check_int(axis, name)
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name} {axis} is out of range for {of}")
    return axis % ndim
