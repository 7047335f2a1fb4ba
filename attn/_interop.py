"""Torch tensors in and out of the core API, without importing torch.

A public function decorated with :func:`accepts_torch` takes CPU torch
tensors wherever it takes arrays: they are viewed as NumPy arrays (no copy,
any strides: ``Tensor.numpy()`` shares the storage), the function runs on
NumPy, and its array results come back as torch tensors sharing the NumPy
results' memory (``torch.from_numpy``). NumPy in, NumPy out: the wrapper then
costs a few type checks. Torch is recognised by the type's module name, so
``import attn`` never imports it.

Tensors attn cannot view are refused with one message saying what to do:
a CUDA/meta (non-CPU) tensor, a tensor that requires grad while autograd is
recording (attn's functions have no backward for torch tensors). bfloat16
tensors are viewed as ``ml_dtypes.bfloat16`` arrays (NumPy has no bfloat16 of
its own; the same bits, no copy) and come back as torch bfloat16.
"""

import functools
import inspect
import sys

import numpy as np

from . import _dtypes


def is_torch(x):
    """True for a torch tensor (or subclass, e.g. ``nn.Parameter``), without importing torch."""
    return type(x).__module__.startswith("torch") and hasattr(x, "numpy")


def _grad_recording():
    torch = sys.modules.get("torch")
    return torch is not None and torch.is_grad_enabled()


def to_numpy(t, name, *, detach=False, to_cpu=False):
    """The NumPy view of torch tensor ``t`` (shared memory), or a ValueError saying what to do.

    The one conversion from torch to NumPy in attn: any strides are read in
    place, lazy conjugate/negative bits are resolved, and bfloat16 is viewed
    as ``ml_dtypes.bfloat16`` (the same bits, no copy; ``Tensor.numpy()``
    refuses bfloat16).

    Parameters
    ----------
    t : torch.Tensor or None
        The tensor (None is returned as None).
    name : str
        The argument's name, for the messages.
    detach : bool
        Read a tensor that requires grad (as ``t.detach()``) even while grad
        recording is on; False refuses it, since attn's functions have no
        backward for torch tensors.
    to_cpu : bool
        Copy a tensor on another device to the CPU (``t.cpu()``); False refuses it.

    Returns
    -------
    ndarray or None
    """
    if t is None:
        return None
    torch = sys.modules["torch"]
    if t.dtype in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)):
        return _float8_view(t, torch, name, detach, to_cpu)
    bf16 = t.dtype is torch.bfloat16
    if not bf16:
        try:  # the common case, a CPU tensor NumPy can view as it is, in one call
            return t.numpy()
        except (RuntimeError, TypeError):  # grad, device, lazy bits: each handled below
            pass
    elif not (t.requires_grad or t.is_neg()) and t.is_cpu:   # (is_cpu: a fifth of device.type's time)
        return _bfloat16_view(t, torch)  # the common bfloat16 case (numpy() refuses it by raising, which costs more)
    device = str(t.device)
    if device != "cpu" and to_cpu:
        t = t.detach().cpu()
    elif device != "cpu":
        raise ValueError(
            f"{name} is a torch tensor on device {device!r}; attn computes on the CPU's memory: "
            f"pass {name}.cpu() (and move the result back with .to({device!r}))"
        )
    if t.requires_grad and not detach and _grad_recording():
        raise ValueError(
            f"{name} requires grad, but attn's functions have no backward for torch tensors: "
            f"pass {name}.detach() or call under torch.no_grad() (for autograd use attn.integrations.torch)"
        )
    t = t.detach()
    if t.is_conj() or t.is_neg():  # lazy conjugation / negation bits: numpy() would refuse
        t = t.resolve_conj().resolve_neg()
    if bf16:
        return _bfloat16_view(t, torch)
    return t.numpy()


def _float8_view(t, torch, name, detach, to_cpu):
    """A float8 tensor's storage as bytes, then as ml_dtypes' float8 of the same name (no copy)."""
    if t.device.type != "cpu":
        if not to_cpu:
            raise ValueError(f"{name} is a torch tensor on device {str(t.device)!r}; attn computes on the CPU's "
                             f"memory: pass {name}.cpu()")
        t = t.cpu()
    return t.detach().view(torch.uint8).numpy().view(_dtypes.float8(str(t.dtype)[len("torch."):]))


def _bfloat16_view(t, torch):
    """CPU bfloat16 tensor ``t``'s storage as 16-bit integers, then as ml_dtypes' bfloat16 (no copy)."""
    return t.view(torch.int16).numpy().view(_dtypes.bfloat16())


#: NumPy dtype characters torch.from_numpy takes as they are: float16, float32, float64.
_TORCH_READS = "efd"


def to_torch(result):
    """NumPy arrays in ``result`` (an array, or a tuple of them) as torch tensors sharing their memory."""
    torch = sys.modules["torch"]
    if type(result) is np.ndarray and result.dtype.char in _TORCH_READS and result.flags.writeable:
        return torch.from_numpy(result)  # the common case: float16/32/64, writeable
    if isinstance(result, tuple):
        return tuple(to_torch(r) for r in result)
    if isinstance(result, np.ndarray):
        if not result.flags.writeable:  # from_numpy warns about read-only arrays (e.g. broadcast views)
            result = result.copy()
        if _dtypes.is_bfloat16(result.dtype):  # torch cannot take ml_dtypes' bfloat16: the same bits
            return torch.from_numpy(result.view(np.int16)).view(torch.bfloat16)
        if _dtypes.is_float8(result.dtype):
            return torch.from_numpy(result.view(np.uint8)).view(getattr(torch, result.dtype.name))
        return torch.from_numpy(result)
    return result


def accepts_torch(*names):
    """Decorator: the arguments ``names`` of the decorated function may be CPU torch tensors.

    When any of them is a torch tensor, every one of them that is gets viewed
    as NumPy (:func:`to_numpy`) and the results come back as torch tensors;
    otherwise the function is called unchanged.
    """
    def decorate(fn):
        params = list(inspect.signature(fn).parameters)
        slots = [(params.index(n), n) for n in names]

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            converted = False
            for i, n in slots:
                x = args[i] if i < len(args) else kwargs.get(n)
                if is_torch(x):
                    if not converted:
                        converted, args = True, list(args)
                    if i < len(args):
                        args[i] = to_numpy(x, n)
                    else:
                        kwargs[n] = to_numpy(x, n)
            return to_torch(fn(*args, **kwargs)) if converted else fn(*args, **kwargs)

        names_list = ", ".join(f"``{n}``" for n in names)
        wrapper.__doc__ = (fn.__doc__ or "").rstrip() + (
            f"\n\n    Torch tensors: {names_list} may be given as CPU torch tensors (any strides; read in place,\n"
            "    not copied); the results are then torch tensors sharing the NumPy results' memory.\n"
            "    bfloat16 tensors are read as ml_dtypes.bfloat16 and returned as torch bfloat16.\n"
            "    CUDA/meta and (with grad recording on) requires-grad tensors are refused.\n")
        return wrapper

    return decorate
