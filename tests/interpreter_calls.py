"""Under the Triton interpreter (CPU tests), a call of a ``@triton.jit`` helper inside a kernel
does not patch ``triton.language`` again where the kernel's launch has patched it already.

Triton's interpreter (3.6 to 3.9, ``triton/runtime/interpreter.py``) patches the language
modules a jitted function's globals name (``_patch_lang``) at each launch, and restores them
after it; it also patches them at every helper call inside the launch
(``InterpretedFunction.__call__``), reading every member of ``triton.language``,
``tl.math``, ``tl.tensor`` and ``tl.core`` each time. On those members the launch's patch has
already replaced every builtin, so the helper's patch changes nothing that runs; it was about
a quarter of the interpreter's time in the model tests (cProfile of
tests/models/test_decode_step.py). :func:`install` skips a helper's patch when every language
module its globals name is one the enclosing launch patched; any other (a helper module
importing ``triton.language.core`` where the kernel's did not) is patched as Triton does.
Where the interpreter does not have the functions this wraps, nothing is installed.
"""

from __future__ import annotations

import inspect
import threading

_launch = threading.local()  # .patched: ids of the language modules the running launch patched
_modules_of: dict = {}  # a jitted function -> the ids of the language modules its globals name


def _language_modules(fn) -> frozenset[int]:
    langs = _modules_of.get(fn)
    if langs is None:  # a module's imports are its top lines: read once per function
        import triton.language as tl

        langs = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        _modules_of[fn] = langs
    return langs


def install() -> bool:
    """Wrap the interpreter's launch and language patch as above; False where it cannot."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang, executor = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or executor is None or scope_type is None or getattr(patch_lang, "_once", False):
        return False
    launch_call = executor.__call__

    def patch_lang_once(fn):
        patched = getattr(_launch, "patched", None)
        langs = _language_modules(fn)
        if patched is not None and langs and langs <= patched:
            return scope_type()  # nothing to restore: the launch's patch stands
        scope = patch_lang(fn)
        if patched is not None:
            patched |= langs
        return scope

    def launch(self, *args, **kwargs):
        outer = getattr(_launch, "patched", None)
        _launch.patched = set()
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            _launch.patched = outer

    patch_lang_once._once = True
    interpreter._patch_lang = patch_lang_once
    executor.__call__ = launch
    return True
