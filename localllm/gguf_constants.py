"""gguf-py's constants (ggml's type ids and block sizes, GGUF's value types), loaded without the rest of gguf-py.

`import gguf` runs gguf-py's __init__, which also imports its reader, writer, quantizers, tensor maps and its
model-card metadata (with PyYAML): 29 ms of smollm2's 0.5 s warm start, which needs three names from
`gguf/constants.py` (its own import: 6 ms). This executes that file as the module `gguf.constants` without its
package (it imports only enum and typing). A later `import gguf` (convert, quantize, the tests) finds it in
sys.modules and re-exports it, so the process has one GGMLQuantizationType, not two that compare unequal; a
one-shot import hook gives that package its `constants` attribute, which a submodule imported first would lack.
"""

from __future__ import annotations

import importlib.util
import os
import sys


class _PackageAttribute:
    """A finder on sys.meta_path (importlib.abc.MetaPathFinder's protocol; importing importlib.abc itself costs
    6 ms): on the first `import gguf` the package module gets `constants` (what importing gguf.constants through
    the package sets) before its __init__ runs; then this finder removes itself."""

    def find_spec(self, name, path=None, target=None):
        if name != "gguf":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec("gguf")
        loader = getattr(spec, "loader", None)
        if loader is not None and hasattr(loader, "exec_module"):
            run_init = loader.exec_module

            def exec_module(module):
                module.constants = sys.modules["gguf.constants"]
                run_init(module)

            loader.exec_module = exec_module
        return spec


def _load():
    mod = sys.modules.get("gguf.constants")
    if mod is not None:
        return mod
    spec = importlib.util.find_spec("gguf")  # finds the package without running its __init__
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], "constants.py")
        own = importlib.util.spec_from_file_location("gguf.constants", path)
        if own is not None and own.loader is not None and os.path.exists(path):
            mod = importlib.util.module_from_spec(own)
            sys.modules["gguf.constants"] = mod
            try:
                own.loader.exec_module(mod)
            except BaseException:
                del sys.modules["gguf.constants"]
                raise
            sys.meta_path.insert(0, _PackageAttribute())
            return mod
    import gguf.constants  # an unusual install (a zip, a frozen app): the whole package

    return gguf.constants


_constants = _load()
GGML_QUANT_SIZES = _constants.GGML_QUANT_SIZES
GGMLQuantizationType = _constants.GGMLQuantizationType
GGUFValueType = _constants.GGUFValueType
