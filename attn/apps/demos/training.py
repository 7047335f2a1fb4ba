"""Train a 2-layer character-level transformer twice: attention by torch, and by attn (float64).

The same model, initial weights, batches and Adam steps; the only difference
is the attention call inside each block: ``torch.nn.functional.
scaled_dot_product_attention`` or :func:`attn.integrations.torch.
scaled_dot_product_attention` (attn's fused forward and backward kernels as a
torch custom operator). In float64 the two loss curves agree to rounding.

The text is the Zen of Python (PEP 20, "placed in the public domain"), kept
in ``attn/apps/demos/data/zen_of_python.txt``: exactly the text of the standard
library's ``this`` module (``codecs.decode(this.s, "rot13")``, plus a final
newline), so it can be reproduced anywhere.

Needs torch. Run: ``python -m attn demo train --plot docs/img/train_loss.png``.
"""

import copy
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TEXT_PATH = Path(__file__).parent / "data" / "zen_of_python.txt"
STEPS, BATCH, BLOCK = 300, 16, 64
D_MODEL, N_HEAD, N_LAYER = 64, 4, 2
LR, SEED = 3e-3, 20261012


def load_text():
    """The training text (str) and its sorted character vocabulary."""
    text = TEXT_PATH.read_text(encoding="utf-8")
    return text, sorted(set(text))


def build_model(torch, vocab, sdpa):
    """A GPT-style char model: embeddings, N_LAYER pre-norm blocks (causal self-attention + MLP), head.

    ``sdpa`` is the attention function ``(q, k, v, is_causal) -> out`` on [B, H, T, Dh] tensors.
    """
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
            self.qkv, self.proj = nn.Linear(D_MODEL, 3 * D_MODEL), nn.Linear(D_MODEL, D_MODEL)
            self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

        def forward(self, x):
            b, t, d = x.shape
            heads = lambda a: a.view(b, t, N_HEAD, d // N_HEAD).transpose(1, 2)  # [B, T, D] -> [B, H, T, Dh]
            q, k, v = (heads(a) for a in self.qkv(self.ln1(x)).split(d, dim=-1))  # strided views
            y = Block.sdpa(q, k, v, is_causal=True)  # [B, H, T, Dh]
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))  # [B, H, T, Dh] -> [B, T, D]
            return x + self.mlp(self.ln2(x))

    Block.sdpa = staticmethod(sdpa)

    class CharModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(len(vocab), D_MODEL), nn.Embedding(BLOCK, D_MODEL)
            self.blocks = nn.Sequential(*[Block() for _ in range(N_LAYER)])
            self.ln, self.head = nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, len(vocab))

        def forward(self, idx):  # [B, T] -> logits [B, T, vocab]
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            return self.head(self.ln(self.blocks(x)))

    return CharModel().double()


@dataclass
class TrainResult:
    losses: dict  # "torch" / "attn" -> list of float, one per step
    seconds_per_step: dict  # "torch" / "attn" -> mean wall time of one step (forward, backward, Adam)
    max_abs_diff: float  # max over steps |loss_attn - loss_torch|
    max_rel_diff: float
    n_chars: int
    vocab: int
    steps: int


def run(steps=STEPS, threads=None):
    """Train both models on the same batches; return their loss curves and step times."""
    import torch
    import torch.nn.functional as F

    from attn.integrations.torch import scaled_dot_product_attention as attn_sdpa

    if threads is not None:
        torch.set_num_threads(threads)
    text, vocab = load_text()
    data = torch.tensor([vocab.index(c) for c in text])
    torch.manual_seed(SEED)
    models = {"torch": build_model(torch, vocab, F.scaled_dot_product_attention)}
    models["attn"] = build_model(torch, vocab, attn_sdpa)
    models["attn"].load_state_dict(copy.deepcopy(models["torch"].state_dict()))  # the same initial weights
    opts = {n: torch.optim.Adam(m.parameters(), lr=LR) for n, m in models.items()}
    rng = np.random.default_rng(SEED)
    losses = {n: [] for n in models}
    seconds = {n: 0.0 for n in models}
    for _ in range(steps):
        starts = rng.integers(0, len(data) - BLOCK - 1, size=BATCH)
        x = torch.stack([data[s:s + BLOCK] for s in starts])  # [B, T] inputs
        y = torch.stack([data[s + 1:s + BLOCK + 1] for s in starts])  # [B, T] next characters
        for name in ("torch", "attn"):
            t0 = time.perf_counter()
            logits = models[name](x)
            loss = F.cross_entropy(logits.reshape(-1, len(vocab)), y.reshape(-1))
            opts[name].zero_grad(set_to_none=True)
            loss.backward()
            opts[name].step()
            seconds[name] += time.perf_counter() - t0
            losses[name].append(loss.item())
    a, t = np.array(losses["attn"]), np.array(losses["torch"])
    return TrainResult(losses, {n: s / steps for n, s in seconds.items()},
                       float(np.max(np.abs(a - t))), float(np.max(np.abs(a - t) / np.abs(t))),
                       len(text), len(vocab), steps)


def report(res):
    lines = [
        f"2-layer char transformer (d_model {D_MODEL}, {N_HEAD} heads, block {BLOCK}, batch {BATCH}, "
        f"float64, Adam lr {LR}) on the Zen of Python ({res.n_chars} chars, {res.vocab} symbols), "
        f"{res.steps} steps",
        f"  loss at step 1: torch {res.losses['torch'][0]:.6f}, attn {res.losses['attn'][0]:.6f}",
        f"  loss at step {res.steps}: torch {res.losses['torch'][-1]:.6f}, attn {res.losses['attn'][-1]:.6f}",
        f"  max |loss_attn - loss_torch| over the steps: {res.max_abs_diff:.2e} "
        f"(relative {res.max_rel_diff:.2e})",
        f"  time per step (forward + backward + Adam): torch SDPA {res.seconds_per_step['torch'] * 1e3:.1f} ms, "
        f"attn bridge {res.seconds_per_step['attn'] * 1e3:.1f} ms",
    ]
    return "\n".join(lines)
