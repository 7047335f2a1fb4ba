"""The gradient of attention, derived step by step on the article's 5-token example.

Forward (causal, d_k = 4, scale s = 1/sqrt(d_k)): S = s Q K^T (+ causal mask),
P = softmax(S) row by row, O = P V. Take the loss ``loss = sum(G o O)`` for a
fixed upstream gradient G, so that dO = dloss/dO = G. Backward:

1. dV = P^T dO                 (O = P V is linear in V)
2. dP = dO V^T                 (... and in P)
3. D  = rowsum(dO o O)          (= rowsum(P o dP): each row's p . dP)
4. dS = P o (dP - D)            (the softmax Jacobian diag(p) - p p^T, row by row)
5. dQ = s dS K,  dK = s dS^T Q  (S = s Q K^T)

Masked entries have P = 0, hence dS = 0: the mask needs no special case.
The result is checked against central finite differences of the forward,
against torch.autograd (when torch is installed) and against every attn
backward form; the report prints the max differences measured in this run.
"""

from dataclasses import dataclass, field

import numpy as np

from attn import _build
from attn._api import scaled_dot_product_attention, scaled_dot_product_attention_vjp
from ._common import SEED, five_tokens, max_abs_diff, optional_torch

FD_STEP = 1e-6  # central differences: truncation O(h^2), rounding O(eps / h)


@dataclass
class BackwardResult:
    """Every intermediate of the hand derivation and the max differences of the checks."""

    q: np.ndarray  # [5, 4]
    k: np.ndarray
    v: np.ndarray
    g: np.ndarray  # dO, the upstream gradient [5, 4]
    steps: dict  # name -> ndarray, in derivation order
    vs_finite_differences: dict  # "dq"/"dk"/"dv" -> max |hand - central difference|
    vs_torch: dict  # "dq"/"dk"/"dv" -> max |hand - torch.autograd| (empty without torch)
    vs_backends: dict = field(default_factory=dict)  # backend -> max |hand - attn vjp| over dq, dk, dv
    torch_version: str = ""


def derive(q, k, v, g):
    """The backward by hand (causal), every step kept: dict name -> ndarray."""
    n, d_k = q.shape
    s = 1.0 / np.sqrt(d_k)
    st = {}
    scores = s * q @ k.T  # [5, 4] @ [4, 5] -> [5, 5]
    st["S = s Q K^T, causal"] = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
    e = np.exp(st["S = s Q K^T, causal"] - st["S = s Q K^T, causal"].max(axis=1, keepdims=True))
    st["P = softmax(S)"] = e / e.sum(axis=1, keepdims=True)  # [5, 5], rows sum to 1
    st["O = P V"] = st["P = softmax(S)"] @ v  # [5, 5] @ [5, 4] -> [5, 4]
    p, o = st["P = softmax(S)"], st["O = P V"]
    st["1. dV = P^T dO"] = p.T @ g  # [5, 5] @ [5, 4] -> [5, 4]
    st["2. dP = dO V^T"] = g @ v.T  # [5, 4] @ [4, 5] -> [5, 5]
    st["3. D = rowsum(dO o O)"] = np.sum(g * o, axis=1, keepdims=True)  # [5, 1]
    st["   (check: rowsum(P o dP))"] = np.sum(p * st["2. dP = dO V^T"], axis=1, keepdims=True)
    st["4. dS = P o (dP - D)"] = p * (st["2. dP = dO V^T"] - st["3. D = rowsum(dO o O)"])  # [5, 5]
    st["5. dQ = s dS K"] = s * st["4. dS = P o (dP - D)"] @ k  # [5, 5] @ [5, 4] -> [5, 4]
    st["5. dK = s dS^T Q"] = s * st["4. dS = P o (dP - D)"].T @ q  # [5, 5] @ [5, 4] -> [5, 4]
    return st


def finite_differences(q, k, v, g, h=FD_STEP):
    """dloss/dq, dk, dv by central differences of loss = sum(g o attention(q, k, v)), one entry at a time."""
    loss = lambda *a: float(np.sum(g * scaled_dot_product_attention(*a, is_causal=True, backend="numpy")))
    grads = []
    for i in range(3):
        x = [q.copy(), k.copy(), v.copy()]
        d = np.zeros_like(x[i])
        for idx in np.ndindex(*x[i].shape):
            x[i][idx] += h
            up = loss(*x)
            x[i][idx] -= 2 * h
            down = loss(*x)
            x[i][idx] += h
            d[idx] = (up - down) / (2 * h)
        grads.append(d)
    return grads


def run(seed=SEED):
    """Derive, then check against finite differences, torch.autograd and attn's backward forms."""
    q, k, v = five_tokens(seed)
    g = np.random.default_rng(seed + 1).normal(size=q.shape)  # dO
    st = derive(q, k, v, g)
    hand = (st["5. dQ = s dS K"], st["5. dK = s dS^T Q"], st["1. dV = P^T dO"])
    names = ("dq", "dk", "dv")
    fd = dict(zip(names, (max_abs_diff(a, b) for a, b in zip(hand, finite_differences(q, k, v, g)))))
    res = BackwardResult(q, k, v, g, st, fd, {})
    torch = optional_torch()
    if torch is not None:
        tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
        out.backward(torch.from_numpy(g))
        res.vs_torch = {n: max_abs_diff(a, t.grad.numpy()) for n, a, t in zip(names, hand, (tq, tk, tv))}
        res.torch_version = torch.__version__
    for backend in ("loop", "numpy", "online") + (("cython",) if _build.HAVE_BACKWARD else ()):
        _, backward = scaled_dot_product_attention_vjp(q, k, v, is_causal=True, backend=backend)
        res.vs_backends[backend] = max(max_abs_diff(a, b) for a, b in zip(hand, backward(g)))
    return res


def _fmt(a):
    return np.array2string(np.asarray(a), precision=4, suppress_small=True, max_line_width=100)


def report(res):
    """The derivation's matrices and the measured differences."""
    lines = [
        "Backward pass of causal attention, 5 tokens, d_k = 4 (seed %d); loss = sum(dO o O)." % SEED,
        "",
        "dO (the upstream gradient):",
        _fmt(res.g),
    ]
    for name, a in res.steps.items():
        lines += ["", name + ":", _fmt(a)]
    lines += ["", "Checks (max |difference| over dQ, dK, dV, from this run):"]
    lines.append("  vs central finite differences (h = %g): %s" % (
        FD_STEP, ", ".join(f"{n} {d:.1e}" for n, d in res.vs_finite_differences.items())))
    if res.vs_torch:
        lines.append("  vs torch.autograd (torch %s):       %s" % (
            res.torch_version, ", ".join(f"{n} {d:.1e}" for n, d in res.vs_torch.items())))
    else:
        lines.append("  vs torch.autograd: torch is not installed")
    lines.append("  vs attn.scaled_dot_product_attention_vjp: " + ", ".join(
        f"{b} {d:.1e}" for b, d in res.vs_backends.items()))
    return "\n".join(lines)
