"""``attn.MultiheadAttention``: a NumPy drop-in for ``torch.nn.MultiheadAttention`` (inference).

Same constructor, call signature, shapes, parameter names and mask
conventions as torch; the attention itself is
:func:`attn.scaled_dot_product_attention`, so torch MHA's conventions are
converted to SDPA's here, explicitly:

* bool masks are inverted: in torch MHA (``key_padding_mask`` and
  ``attn_mask``) True = NOT allowed; in SDPA True = takes part. Float masks
  are added to the scores in both.
* ``key_padding_mask`` [N, S] and ``attn_mask`` [L, S] or [N * n_head, L, S]
  are merged into one SDPA mask (bool AND when both are bool, else the sum
  of their float forms, as torch does). ``key_padding_mask`` alone stays a
  broadcast view [N, 1, 1, S].
* ``need_weights=False`` calls the fused kernel path (no L x S scores);
  ``need_weights=True`` asks SDPA for ``return_weights``.
* ``is_causal`` is a hint that ``attn_mask`` is the causal mask, as in
  torch: ``attn_mask`` is required, and without ``key_padding_mask`` and
  ``need_weights`` the mask is dropped for the kernel's causal path.

One deliberate difference: a query row whose keys are all masked (e.g. a
batch row that is entirely padding) gets attention output 0 (so the module
returns ``out_proj.bias`` there) and weights 0, where torch returns NaN
(with ``need_weights=True``, and on its batch-first self-attention fast
path; torch's ``need_weights=False`` SDPA path also gives 0).
"""

import math
import numbers
from collections import OrderedDict

import numpy as np

from .. import _dtypes
from .._api import scaled_dot_product_attention
from .._integers import check_int
from .._interop import is_torch, to_numpy, to_torch
from .multi_head import merge_heads, project, split_heads
from .._validation import as_float_array, describe_array


def _float_dtype(dtype):
    """numpy float dtype from a numpy/str/torch dtype; None = float32 (torch's default)."""
    return np.dtype(np.float32) if dtype is None else _dtypes.as_dtype(dtype)


def _float_array(x, name):
    """A torch tensor or array_like as an ndarray (detached, on the CPU)."""
    if is_torch(x):
        x = to_numpy(x, name, detach=True, to_cpu=True)
    return as_float_array(x, name)


# ----------------------------------------------------------------------------
# mask conventions: torch MHA -> SDPA
# ----------------------------------------------------------------------------


def _mask_array(m, name):
    if is_torch(m):
        m = to_numpy(m, name, detach=True, to_cpu=True)
    m = np.asarray(m)
    if m.dtype != np.bool_ and not _dtypes.is_float(m.dtype):
        raise TypeError(
            f"{name} must be a bool array (True = NOT allowed, torch MHA's convention) or a float "
            f"array (added to the scores); got {describe_array(m)}"
        )
    return m


def mha_mask_to_sdpa(m, dtype):
    """One torch-MHA mask in SDPA's convention: bool inverted (True = takes part), float unchanged."""
    return ~m if m.dtype == np.bool_ else m.astype(dtype, copy=False)


def _pad_keys(m, n_extra):
    """Append ``n_extra`` always-allowed key columns (bias_k / zero attention) to an SDPA mask."""
    if n_extra == 0:
        return m
    fill = np.ones if m.dtype == np.bool_ else np.zeros
    return np.concatenate([m, fill(m.shape[:-1] + (n_extra,), dtype=m.dtype)], axis=-1)


def _as_bias(m):
    """SDPA bool mask (True = takes part) as the float mask 0 / -inf; float masks unchanged."""
    return np.where(m, 0.0, -np.inf) if m.dtype == np.bool_ else m


def merge_masks(key_padding_mask, attn_mask, n_batch, n_head, dtype, n_extra=0):
    """torch MHA's two masks as one SDPA mask broadcastable to [N, n_head, L, S + n_extra].

    Parameters
    ----------
    key_padding_mask : ndarray [N, S] of bool (True = padding) or float, or None
    attn_mask : ndarray [L, S] or [N * n_head, L, S] of bool (True = not allowed) or float, or None
    n_batch, n_head : int
    dtype : the compute dtype of float masks
    n_extra : int
        Key columns appended by ``add_bias_kv`` / ``add_zero_attn``; always allowed.

    Returns
    -------
    ndarray of bool (True = takes part) or of ``dtype`` (added), or None:
    [N, 1, 1, S'] from ``key_padding_mask`` alone, [L, S'] or [N, n_head, L, S']
    from ``attn_mask``, their broadcast when both.
    """
    kp = am = None
    if key_padding_mask is not None:
        kp = mha_mask_to_sdpa(key_padding_mask, dtype)[:, None, None, :]  # [N, S] -> [N, 1, 1, S]
        kp = _pad_keys(kp, n_extra)
    if attn_mask is not None:
        am = mha_mask_to_sdpa(attn_mask, dtype)
        if am.ndim == 3:
            am = am.reshape(n_batch, n_head, *am.shape[1:])  # [N * n_head, L, S] -> [N, n_head, L, S]
        am = _pad_keys(am, n_extra)
    if kp is None or am is None:
        return am if kp is None else kp
    if kp.dtype == am.dtype == np.bool_:
        return am & kp  # takes part iff neither mask excludes it
    return (_as_bias(am) + _as_bias(kp)).astype(dtype, copy=False)  # torch adds the float forms


# ----------------------------------------------------------------------------
# the module
# ----------------------------------------------------------------------------


class MultiheadAttention:
    """Multi-head attention with ``torch.nn.MultiheadAttention``'s interface, in NumPy.

    ``out = concat(head_1, ..., head_h) @ W_o^T + b_o`` with
    ``head_i = softmax(q_i k_i^T / sqrt(d_k) + mask) v_i``, ``d_k = embed_dim / num_heads``.
    Inference only: behaves like a torch module in ``eval()`` mode (``dropout``
    is kept for the round trip but never applied).

    Parameters
    ----------
    embed_dim : int
        ``d_model``, the size of the queries and of the output.
    num_heads : int
        ``n_head``; must divide ``embed_dim``.
    dropout : float
        Stored only (see above).
    bias : bool
        Biases on the input and output projections.
    add_bias_kv : bool
        Learned key and value rows appended to the sequence (``bias_k``, ``bias_v``).
    add_zero_attn : bool
        A zero key and value appended to every head's sequence.
    kdim, vdim : int, optional
        Sizes of the key and value inputs (default ``embed_dim``).
    batch_first : bool
        Batched inputs are [N, L, E] instead of [L, N, E].
    device : None or "cpu"
        For signature compatibility.
    dtype : float16, bfloat16, float32 or float64 (numpy, its name, or torch dtype), default float32
    rng : numpy.random.Generator, optional
        Source of the initial parameters (default ``np.random.default_rng(0)``:
        deterministic). Distributions as torch: xavier-uniform input
        projections, uniform(+-1/sqrt(E)) output projection, zero biases,
        xavier-normal ``bias_k``/``bias_v``.
    backend : {"auto", "loop", "numpy", "cython"}
        Passed to :func:`attn.scaled_dot_product_attention`.
    num_threads : int, optional
        Threads for the cython backend.

    Attributes
    ----------
    w_q : ndarray [E, E]; w_k : ndarray [kdim, E]; w_v : ndarray [vdim, E]; w_o : ndarray [E, E]
        Projections in NumPy's ``x @ W`` convention (torch's weights transposed).
    b_q, b_k, b_v, b_o : ndarray [E] or None
    bias_k, bias_v : ndarray [E] or None
    """

    def __init__(
        self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
        kdim=None, vdim=None, batch_first=False, device=None, dtype=None, *, rng=None,
        backend="auto", num_threads=None,
    ):
        self.embed_dim = check_int(embed_dim, "embed_dim", minimum=1)
        self.num_heads = check_int(num_heads, "num_heads", minimum=1)
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        self.head_dim = self.embed_dim // self.num_heads
        self.kdim = self.embed_dim if kdim is None else check_int(kdim, "kdim", minimum=1)
        self.vdim = self.embed_dim if vdim is None else check_int(vdim, "vdim", minimum=1)
        self._qkv_same_embed_dim = self.kdim == self.embed_dim and self.vdim == self.embed_dim
        if not isinstance(dropout, numbers.Real) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a float in [0, 1), got {dropout!r}")
        if device not in (None, "cpu"):
            raise ValueError(f"device must be None or 'cpu', got {device!r}")
        self.dropout = float(dropout)
        self.bias = bool(bias)
        self.add_bias_kv = bool(add_bias_kv)
        self.add_zero_attn = bool(add_zero_attn)
        self.batch_first = bool(batch_first)
        self.dtype = _float_dtype(dtype)
        self.backend = backend
        self.num_threads = num_threads
        self.reset_parameters(rng)

    def __repr__(self):
        extra = "".join(
            f", {k}={getattr(self, k)}"
            for k in ("kdim", "vdim", "add_bias_kv", "add_zero_attn", "batch_first")
            if getattr(self, k) not in (False, self.embed_dim)
        )
        return (f"MultiheadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}{extra}, "
                f"dtype={self.dtype})")

    # ---------------------------------------------------------------- params

    def reset_parameters(self, rng=None):
        """Draw the parameters as torch initializes them, from ``rng`` (default seed 0)."""
        rng = np.random.default_rng(0) if rng is None else rng
        if not isinstance(rng, np.random.Generator):
            raise TypeError(f"rng must be a numpy.random.Generator or None, got {type(rng).__name__}")
        E, dt = self.embed_dim, self.dtype
        if self._qkv_same_embed_dim:
            w_in = _xavier_uniform(rng, (3 * E, E))  # torch's in_proj_weight, rows q, k, v
            self.w_q, self.w_k, self.w_v = (w.T.astype(dt) for w in np.split(w_in, 3))
        else:
            self.w_q = _xavier_uniform(rng, (E, E)).T.astype(dt)
            self.w_k = _xavier_uniform(rng, (E, self.kdim)).T.astype(dt)
            self.w_v = _xavier_uniform(rng, (E, self.vdim)).T.astype(dt)
        bound = 1 / math.sqrt(E)  # torch Linear's default: kaiming-uniform(a=sqrt(5)) = U(+-1/sqrt(fan_in))
        self.w_o = rng.uniform(-bound, bound, (E, E)).T.astype(dt)
        zeros = (lambda: np.zeros(E, dt)) if self.bias else (lambda: None)
        self.b_q, self.b_k, self.b_v, self.b_o = zeros(), zeros(), zeros(), zeros()
        std = math.sqrt(2.0 / (E + E))  # xavier-normal of torch's [1, 1, E] parameter
        self.bias_k = rng.normal(0, std, E).astype(dt) if self.add_bias_kv else None
        self.bias_v = rng.normal(0, std, E).astype(dt) if self.add_bias_kv else None

    def _torch_layout(self):
        """(name, array in torch's layout, expected shape) of every parameter, in torch's order."""
        E = self.embed_dim
        out = []
        if self._qkv_same_embed_dim:
            w = np.concatenate([self.w_q.T, self.w_k.T, self.w_v.T])  # [3E, E], rows q, k, v
            out.append(("in_proj_weight", w))
        else:
            out += [(f"{n}_proj_weight", w.T) for n, w in zip("qkv", (self.w_q, self.w_k, self.w_v))]
        if self.bias:
            out.append(("in_proj_bias", np.concatenate([self.b_q, self.b_k, self.b_v])))
        if self.add_bias_kv:
            out += [("bias_k", self.bias_k.reshape(1, 1, E)), ("bias_v", self.bias_v.reshape(1, 1, E))]
        out.append(("out_proj.weight", self.w_o.T))
        if self.bias:
            out.append(("out_proj.bias", self.b_o))
        return out

    def state_dict(self, *, as_torch=False):
        """Parameters under torch's names and layouts, in torch's order.

        Parameters
        ----------
        as_torch : bool
            Return ``torch.Tensor`` values (imports torch), which
            ``torch.nn.MultiheadAttention.load_state_dict`` requires; default
            NumPy arrays (copies).

        Returns
        -------
        OrderedDict: ``in_proj_weight`` [3E, E] (or ``q_proj_weight`` [E, E],
        ``k_proj_weight`` [E, kdim], ``v_proj_weight`` [E, vdim]),
        ``in_proj_bias`` [3E], ``bias_k``/``bias_v`` [1, 1, E],
        ``out_proj.weight`` [E, E], ``out_proj.bias`` [E], as configured.
        """
        sd = OrderedDict((name, np.array(a)) for name, a in self._torch_layout())
        if as_torch:
            import torch  # noqa: F401 (to_torch finds it loaded)

            sd = OrderedDict((name, to_torch(a)) for name, a in sd.items())
        return sd

    def load_state_dict(self, state_dict):
        """Load torch's parameter names and layouts (tensors or arrays); strict like torch.

        Every expected key (see :meth:`state_dict`) must be present with its
        shape, and no other key. Values are copied and cast to ``self.dtype``.
        """
        expected = {name: a.shape for name, a in self._torch_layout()}
        missing, unexpected = sorted(set(expected) - set(state_dict)), sorted(set(state_dict) - set(expected))
        if missing or unexpected:
            raise KeyError(
                f"state_dict does not match this module ({self!r}): missing {missing}, "
                f"unexpected {unexpected}"
            )
        sd = {}
        for name, shape in expected.items():
            a = _float_array(state_dict[name], f"state_dict[{name!r}]")
            if a.shape != shape:
                raise ValueError(f"state_dict[{name!r}] must have shape {shape}; got {describe_array(a)}")
            sd[name] = a.astype(self.dtype)  # a copy
        self._set_from_torch_layout(sd)
        return self

    def _set_from_torch_layout(self, sd):
        E = self.embed_dim
        if self._qkv_same_embed_dim:
            self.w_q, self.w_k, self.w_v = (w.T for w in np.split(sd["in_proj_weight"], 3))  # rows q, k, v
        else:
            self.w_q, self.w_k, self.w_v = (sd[f"{n}_proj_weight"].T for n in "qkv")
        if self.bias:
            self.b_q, self.b_k, self.b_v = np.split(sd["in_proj_bias"], 3)
            self.b_o = sd["out_proj.bias"]
        self.w_o = sd["out_proj.weight"].T
        if self.add_bias_kv:
            self.bias_k, self.bias_v = sd["bias_k"].reshape(E), sd["bias_v"].reshape(E)

    @classmethod
    def from_torch(cls, module, *, backend="auto", num_threads=None):
        """An ``attn.MultiheadAttention`` with the configuration and (copied) weights of a torch one."""
        new = cls(
            module.embed_dim, module.num_heads, dropout=module.dropout,
            bias=module.in_proj_bias is not None, add_bias_kv=module.bias_k is not None,
            add_zero_attn=module.add_zero_attn, kdim=module.kdim, vdim=module.vdim,
            batch_first=module.batch_first, dtype=module.out_proj.weight.dtype,
            backend=backend, num_threads=num_threads,
        )
        return new.load_state_dict(module.state_dict())

    def eval(self):
        """No-op returning ``self`` (always in inference mode), for torch-style code."""
        return self

    # ---------------------------------------------------------------- forward

    def __call__(
        self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
        average_attn_weights=True, is_causal=False,
    ):
        """Attend from ``query`` to ``key``/``value``, exactly as torch's ``forward``.

        Parameters
        ----------
        query : array_like [L, N, E] ([N, L, E] if ``batch_first``) or [L, E] unbatched
        key : array_like [S, N, kdim] ([N, S, kdim]) or [S, kdim]
        value : array_like [S, N, vdim] ([N, S, vdim]) or [S, vdim]
            The module's dtype.
        key_padding_mask : array_like [N, S] or [S], bool or float, optional
            bool True = this key is padding and is ignored; float is added.
        need_weights : bool
            Also return attention weights (otherwise the fused kernel runs
            and no L x S array exists).
        attn_mask : array_like [L, S] or [N * num_heads, L, S] ([num_heads, L, S] unbatched), optional
            bool True = NOT allowed to attend; float is added.
        average_attn_weights : bool
            Average the weights over heads.
        is_causal : bool
            Hint that ``attn_mask`` is the causal mask (``attn_mask`` is required).

        Returns
        -------
        out : ndarray [L, N, E] ([N, L, E] if ``batch_first``) or [L, E]
        weights : ndarray [N, L, S] ([N, num_heads, L, S] without averaging;
            no N unbatched), or None without ``need_weights``. ``S`` counts
            the ``bias_k`` and zero-attention keys.
        """
        q, k, v, kpm, am, batched = self._check_call(
            query, key, value, key_padding_mask, attn_mask, is_causal)
        use_causal = bool(is_causal) and kpm is None and not need_weights  # torch drops the mask here
        n_batch, n_head = q.shape[0], self.num_heads
        n_extra = int(self.add_bias_kv) + int(self.add_zero_attn)
        mask = None if use_causal else merge_masks(kpm, am, n_batch, n_head, self.dtype, n_extra)
        qh, kh, vh = self._project_heads(q, k, v)
        res = scaled_dot_product_attention(
            qh, kh, vh, mask, is_causal=use_causal, backend=self.backend,
            return_weights=bool(need_weights), num_threads=self.num_threads,
        )
        heads, w = res if need_weights else (res, None)  # [N, n_head, L, d_k]
        out = project(merge_heads(heads), self.w_o, self.b_o)  # [N, L, E]
        if w is not None and average_attn_weights:
            w = w.mean(axis=1)  # [N, n_head, L, S] -> [N, L, S]
        if not batched:
            return out[0], (None if w is None else w[0])
        return (out if self.batch_first else np.swapaxes(out, 0, 1)), w

    forward = __call__

    def _project_heads(self, q, k, v):
        """Projected heads [N, n_head, T, d_k], with the bias_k / zero-attention keys appended."""
        n_batch = q.shape[0]
        k, v = project(k, self.w_k, self.b_k), project(v, self.w_v, self.b_v)  # [N, S, E]
        if self.add_bias_kv:
            row = (n_batch, 1, self.embed_dim)
            k = np.concatenate([k, np.broadcast_to(self.bias_k, row)], axis=1)  # [N, S, E] -> [N, S+1, E]
            v = np.concatenate([v, np.broadcast_to(self.bias_v, row)], axis=1)
        qh = split_heads(project(q, self.w_q, self.b_q), self.num_heads)  # [N, L, E] -> [N, n_head, L, d_k]
        kh = split_heads(k, self.num_heads)  # [N, S', E] -> [N, n_head, S', d_k]
        vh = split_heads(v, self.num_heads)
        if self.add_zero_attn:
            zero = np.zeros(kh.shape[:2] + (1, self.head_dim), self.dtype)
            kh = np.concatenate([kh, zero], axis=2)  # [N, n_head, S'+1, d_k]
            vh = np.concatenate([vh, zero], axis=2)
        return qh, kh, vh

    def _check_call(self, query, key, value, key_padding_mask, attn_mask, is_causal):
        """Validated inputs as [N, T, features] (N = 1 when unbatched) and masks as arrays."""
        q, k, v = (_float_array(a, n) for a, n in ((query, "query"), (key, "key"), (value, "value")))
        for name, a in (("query", q), ("key", k), ("value", v)):
            if a.dtype != self.dtype:
                raise TypeError(f"{name} must have the module's dtype {self.dtype}; got {describe_array(a)}")
        if q.ndim not in (2, 3) or k.ndim != q.ndim or v.ndim != q.ndim:
            raise ValueError(
                "query, key and value must all be 3-D (batched) or all 2-D (unbatched); got "
                f"query {q.shape}, key {k.shape}, value {v.shape}"
            )
        batched = q.ndim == 3
        if not batched:
            q, k, v = q[None], k[None], v[None]  # [T, E] -> [1, T, E]
        elif not self.batch_first:
            q, k, v = (np.swapaxes(a, 0, 1) for a in (q, k, v))  # [T, N, E] -> [N, T, E]
        self._check_shapes(q, k, v, batched)
        n_batch, n_q, n_k = q.shape[0], q.shape[1], k.shape[1]
        kpm = _mask_array_or_none(key_padding_mask, "key_padding_mask")
        am = _mask_array_or_none(attn_mask, "attn_mask")
        if kpm is not None:
            want = (n_batch, n_k) if batched else (n_k,)
            if kpm.shape != want:
                raise ValueError(f"key_padding_mask must have shape {want} (batch, S); got {describe_array(kpm)}")
            kpm = kpm.reshape(n_batch, n_k)
        if am is not None:
            wants = [(n_q, n_k), ((n_batch if batched else 1) * self.num_heads, n_q, n_k)]
            if am.shape not in wants:
                raise ValueError(
                    f"attn_mask must have shape {wants[0]} or {wants[1]} (batch * num_heads, L, S); "
                    f"got {describe_array(am)}"
                )
        if is_causal and am is None:
            raise ValueError(
                "is_causal=True is a hint that attn_mask is the causal mask (torch's convention) and "
                "needs attn_mask; pass attn_mask=np.triu(np.ones((L, S), bool), 1)"
            )
        return q, k, v, kpm, am, batched

    def _check_shapes(self, q, k, v, batched):
        layout = "[N, T, features]" if self.batch_first or not batched else "[T, N, features]"
        for name, a, dim in (("query", q, self.embed_dim), ("key", k, self.kdim), ("value", v, self.vdim)):
            if a.shape[-1] != dim:
                shown = _shown(a, batched, self.batch_first)
                raise ValueError(f"{name} must have last dim {dim}; got shape {shown}")
        if k.shape[:2] != v.shape[:2] or (batched and q.shape[0] != k.shape[0]):
            raise ValueError(
                f"query, key and value must agree on batch size and key/value on length ({layout}); "
                f"got query "
                f"{_shown(q, batched, self.batch_first)}, key {_shown(k, batched, self.batch_first)}, "
                f"value {_shown(v, batched, self.batch_first)}"
            )


def _shown(a, batched, batch_first):
    """The shape the caller passed, before the [N, T, E] normalization."""
    if not batched:
        return a.shape[1:]
    return a.shape if batch_first else (a.shape[1], a.shape[0], a.shape[2])


def _mask_array_or_none(m, name):
    return None if m is None else _mask_array(m, name)


def _xavier_uniform(rng, shape):
    """torch's ``xavier_uniform_`` on a [fan_out, fan_in] matrix: U(+-sqrt(6 / (fan_in + fan_out)))."""
    bound = math.sqrt(6.0 / (shape[0] + shape[1]))
    return rng.uniform(-bound, bound, shape)
