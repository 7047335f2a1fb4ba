"""The backward demo's derivation against torch.autograd (independent), and its report."""

import numpy as np
import torch

from attn.apps.demos import backward
from attn.apps.demos._common import five_tokens


def test_steps_match_torch_autograd():
    res = backward.run()
    q, k, v = five_tokens()
    assert np.array_equal(res.q, q)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    scores = tq @ tk.T / 2.0
    scores.retain_grad()
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    p = torch.softmax(scores.masked_fill(~mask, -torch.inf), dim=-1)
    p.retain_grad()
    out = p @ tv
    out.backward(torch.from_numpy(res.g))
    st = res.steps
    tol = 1e-14
    assert np.max(np.abs(st["O = P V"] - out.detach().numpy())) < tol
    assert np.max(np.abs(st["2. dP = dO V^T"] - p.grad.numpy())) < tol
    assert np.max(np.abs(st["4. dS = P o (dP - D)"] - scores.grad.numpy())) < tol  # dloss/d(scaled S)
    for name, t in (("5. dQ = s dS K", tq), ("5. dK = s dS^T Q", tk), ("1. dV = P^T dO", tv)):
        assert np.max(np.abs(st[name] - t.grad.numpy())) < tol
    assert np.allclose(st["3. D = rowsum(dO o O)"], st["   (check: rowsum(P o dP))"], rtol=0, atol=1e-14)


def test_report_prints_measured_differences():
    res = backward.run()
    assert max(res.vs_finite_differences.values()) < 1e-8  # h = 1e-6: O(h^2) + O(eps / h)
    assert max(res.vs_torch.values()) < 1e-14
    assert set(res.vs_backends) >= {"loop", "numpy", "online"} and max(res.vs_backends.values()) < 1e-14
    text = backward.report(res)
    assert "vs central finite differences" in text and f"{res.vs_finite_differences['dq']:.1e}" in text
