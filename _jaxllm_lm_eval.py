"""lm_eval's `jaxllm` model type without an import: `lm_eval --model jaxllm --model_args run=RUN`.

lm-evaluation-harness 0.4 has no plugin discovery: a model type comes from its own table
(`lm_eval.models.MODEL_MAPPING`) or from a `register_model` call made at import. The installed
`jaxllm_lm_eval.pth` imports this module at interpreter start; it imports nothing but `sys`
and adds one finder to `sys.meta_path`. When (and only when) `lm_eval.models` is imported, the
finder lets the real module load and then registers `jaxllm` in lm_eval's model registry as the
lazy placeholder `jaxllm.harness:JaxllmLM`, so jax and jaxllm load only when a run asks for the
`jaxllm` model. Importing `jaxllm.harness` later upgrades the placeholder to the class (the
registry allows exactly that).
"""

import sys

TARGET = "lm_eval.models"
PLACEHOLDER = "jaxllm.harness:JaxllmLM"


def register(models) -> None:
    """Add `jaxllm` to lm_eval's model registry (a no-op when it is there)."""
    from lm_eval.api.registry import model_registry

    if "jaxllm" not in model_registry:
        model_registry.register("jaxllm", target=PLACEHOLDER)


class _Loader:
    """The real loader of `lm_eval.models`, then `register`."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        register(module)

    def __getattr__(self, name):  # get_code, get_source, is_package, ...: the real loader's
        return getattr(self.loader, name)


class Finder:
    """A `sys.meta_path` finder that answers only for `lm_eval.models`, by asking the others."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Put the finder first on `sys.meta_path` once (registers at once if lm_eval is loaded)."""
    if TARGET in sys.modules:
        register(sys.modules[TARGET])
        return
    if not any(isinstance(f, Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, Finder())
