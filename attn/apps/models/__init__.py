"""Language models written in NumPy around attn (needs the ``models`` extra: gguf, regex, jinja2).

:mod:`attn.apps.models.llama` is a Llama forward pass; :mod:`attn.apps.models.gguf`
reads its weights, hyper-parameters, tokenizer and chat template from a GGUF
file; :mod:`attn.apps.models.generate` is ``python -m attn generate``.
Nothing here is imported by ``import attn``.
"""
