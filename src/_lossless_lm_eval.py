"""Start-up hook that makes `lm_eval --model lossless` work without importing anything heavy.

`lossless-lm-eval.pth` (installed next to this file) calls `install()` when Python starts. It only adds
a finder to `sys.meta_path`: when `lm_eval.models` is first imported, "lossless" is registered as a lazy
entry (`lossless.evaluation.harness:LosslessLM`), so torch and the model load only if that model is asked for.
"""

import importlib.abc
import importlib.machinery
import sys

NAME = "lossless"
TARGET = "lossless.evaluation.harness:LosslessLM"


def register() -> None:
    from lm_eval.api.registry import model_registry

    if NAME not in model_registry:
        model_registry.register(NAME, target=TARGET)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        try:
            register()
        except Exception:  # never break lm_eval itself
            pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "lm_eval.models":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
