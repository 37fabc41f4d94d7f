"""Hooks into SGLang internals, one module per hooked function (none yet).

Each module must say why the hook is needed and which SGLang versions it was checked against,
and should be installed through SGLang's HookRegistry from ``sglang_ddtree.plugin.register``.
"""
