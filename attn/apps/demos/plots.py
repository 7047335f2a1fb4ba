"""Figures for the ``scaling`` and ``masks`` demos (matplotlib, Agg backend).

matplotlib is the optional extra ``plot`` (from a clone: ``pip install ".[plot]"``, or
``pip install matplotlib``). Importing this module does not need it; drawing raises
ImportError without it, and the CLI then prints :data:`INSTALL_HINT` after the results.
"""

import numpy as np

INSTALL_HINT = ("no plot written: --plot needs matplotlib (pip install matplotlib, or from a clone "
                "pip install \".[plot]\")")


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (ImportError if missing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scaling(rows, path):
    """Sorted softmax weights of the 2000 keys, unscaled vs scaled, one panel per d_k.

    Parameters
    ----------
    rows : list of attn.apps.demos.scaling.ScalingRow
    path : str or path-like, the PNG to write
    """
    plt = pyplot()
    fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 3.6), sharey=True, layout="constrained")
    for ax, row in zip(np.atleast_1d(axes), rows):
        rank = np.arange(1, row.weights_raw.size + 1)
        ax.loglog(rank, np.sort(row.weights_raw)[::-1], label=f"q.k  (eff. keys {row.effective_raw:.2f})")
        ax.loglog(rank, np.sort(row.weights_scaled)[::-1],
                  label=f"q.k / sqrt(d_k)  (eff. keys {row.effective_scaled:.2f})")
        ax.axhline(1 / row.weights_raw.size, color="grey", lw=0.8, ls=":", label="uniform 1/2000")
        ax.set_ylim(1e-12, 1.5)
        ax.set_title(f"d_k = {row.d_k}: max weight {row.max_weight_raw:.3f} vs {row.max_weight_scaled:.4f}",
                     fontsize=9)
        ax.set_xlabel("key rank (by weight)")
        ax.legend(fontsize=7, loc="lower left")
    np.atleast_1d(axes)[0].set_ylabel("softmax weight")
    fig.suptitle("Softmax weights over 2000 keys, without and with the 1/sqrt(d_k) scale")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_masks(result, path):
    """5 x 5 weight heatmaps: no mask, causal (-inf), and the flipped bool convention.

    Parameters
    ----------
    result : attn.apps.demos.masks.MasksResult
    path : str or path-like, the PNG to write
    """
    plt = pyplot()
    panels = [
        ("no mask", result.causal.weights),
        ("causal mask (-inf)", result.causal.causal_weights),
        ("causal mask, convention flipped", result.flip.inverted_weights),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.9), layout="constrained")
    for ax, (title, w) in zip(axes, panels):
        im = ax.imshow(w, vmin=0, vmax=1, cmap="viridis")
        for (i, j), x in np.ndenumerate(w):
            ax.text(j, i, f"{x:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if x < 0.5 else "black")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("key position")
    axes[0].set_ylabel("query position")
    fig.colorbar(im, ax=axes, shrink=0.8, label="attention weight")
    fig.suptitle("Attention weights, 5 tokens, d_k = 4")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_training(result, path):
    """The two loss curves of the training demo (torch SDPA vs attn through the torch bridge).

    Parameters
    ----------
    result : attn.apps.demos.training.TrainResult
    path : str or path-like, the PNG to write
    """
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
    steps = np.arange(1, result.steps + 1)
    ax.plot(steps, result.losses["torch"], lw=2.5, alpha=0.6, label="torch SDPA")
    ax.plot(steps, result.losses["attn"], lw=1, ls="--", color="k", label="attn (torch bridge)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title("2-layer char transformer, float64, Zen of Python", fontsize=9)
    ax.legend()
    diff = np.abs(np.array(result.losses["attn"]) - np.array(result.losses["torch"]))
    ax2.semilogy(steps, np.maximum(diff, 1e-18), lw=1)
    ax2.set_xlabel("step")
    ax2.set_ylabel("|loss attn - loss torch| (0 drawn at 1e-18)")
    ax2.set_title(f"max {result.max_abs_diff:.1e}; ms/step torch {result.seconds_per_step['torch'] * 1e3:.1f}, "
                  f"attn {result.seconds_per_step['attn'] * 1e3:.1f}", fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)
