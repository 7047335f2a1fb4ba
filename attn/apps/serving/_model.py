"""The model ``python -m attn serve`` hands to transformers' server: a GGUF file as a transformers checkpoint.

transformers' server names GGUF weights ``<repo>:<file>.gguf`` and loads
them with ``from_pretrained(repo, gguf_file=file)``, but then looks the model
class up in the config's ``architectures``, which a config read out of a GGUF
file does not have (transformers 5.22 and 5.24: ``TypeError: 'NoneType'
object is not subscriptable`` at startup). So a GGUF file is served as the
transformers checkpoint it loads into: :func:`checkpoint` loads it once with
transformers' own GGUF loader (weights dequantized to float32, tokenizer and
chat template from the file's metadata), writes that model, its generation
config and tokenizer with ``save_pretrained`` into a cache directory named
after the file's contents, and returns the directory. transformers' server
then loads it like any local checkpoint, offline. The weights are the same
tensors bit for bit (tests/test_serve.py checks the logits).
"""

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

SOURCE_FILE = "attn_gguf_source.json"  # in a converted checkpoint: which GGUF file it came from


def default_cache_dir():
    """Where converted checkpoints are kept: ``$XDG_CACHE_HOME/attn/serve`` (default ``~/.cache/attn/serve``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attn" / "serve"


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint(gguf_path, cache_dir=None, log=print):
    """The transformers checkpoint directory of GGUF file ``gguf_path``, converted on first use.

    Parameters
    ----------
    gguf_path : path of a ``.gguf`` file of an architecture transformers' GGUF loader reads
    cache_dir : where converted checkpoints are kept (default :func:`default_cache_dir`)
    log : called with one line when a conversion starts

    Returns
    -------
    pathlib.Path, ``cache_dir/<file stem>-<first 12 hex digits of the file's SHA-256>``
    """
    gguf_path = Path(gguf_path).resolve()
    digest = _sha256(gguf_path)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / f"{gguf_path.stem}-{digest[:12]}"
    if (target / SOURCE_FILE).is_file():  # written last: a directory without it is not complete
        return target
    log(f"converting {gguf_path.name} into a transformers checkpoint (once) in {target}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=cache_dir))
    try:
        _convert(gguf_path, tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({"gguf_file": gguf_path.name, "sha256": digest}, indent=1) + "\n")
        if target.exists():  # an incomplete one, left by an interrupted conversion
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf_path, out):
    """Load ``gguf_path`` with transformers' GGUF loader and write it as a plain checkpoint into ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The loaded model is marked as quantized (GGUF), which save_pretrained refuses; its tensors are
    # already dequantized. Build the same model from a config without the mark (and with the
    # architecture transformers' server looks up), give it those tensors, and save that.
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)
    settings["architectures"] = [type(loaded).__name__]
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
