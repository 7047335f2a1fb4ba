"""Bridges to other libraries, imported on demand (``import attn`` imports none of them).

* ``attn.integrations.torch``: attention as a torch custom operator with autograd;
* ``attn.integrations.transformers``: attn as an attention implementation of Hugging Face transformers.
"""
