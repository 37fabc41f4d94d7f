"""sglang-ddtree: DDTree speculative decoding for SGLang, with every step on the GPU.

Public API: :mod:`sglang_ddtree.ddtree` (``topk_logprobs``, ``build_tree``, ``accept_greedy``).
The SGLang plugin entry point is :func:`sglang_ddtree.plugin.register`.

``sglang_ddtree.kernels`` and ``sglang_ddtree.patches`` are the checkout's top-level ``kernels/``
and ``patches/`` folders, mapped into the package by pyproject (a wheel holds them inside it; an
editable install maps them; the GPU test bed lays the package out the same way with symlinks).
"""
__version__ = "0.1.0"
