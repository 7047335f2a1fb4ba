"""The applications built on the library, apart from it: ``import attn`` imports none of them.

``bench/``    the benchmark suite (``python -m attn bench``; in a clone ``python -m pytest bench``)
``demos/``    the seed article's experiments (``python -m attn demo NAME``)
``models/``   SmolLM2 written in NumPy on attn (``python -m attn generate``, ``python -m attn.apps.models.e2e``)
``serving/``  transformers' server with attn as its attention (``python -m attn serve``)

They import the library (:mod:`attn` and, where they measure or report its
kernels, its private modules); the library never imports them.
"""
