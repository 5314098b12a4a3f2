"""flash-attn's module names on tileflash, for code that imports flash-attn and should run unchanged:

    import tileflash.integrations.flash_attn as tf_compat
    tf_compat.install()         # once, before the code that imports flash_attn / flash_attn_interface

after which `import flash_attn` (2.x: fa2.py, also as `flash_attn.flash_attn_interface`), `flash_attn.bert_padding`
(bert_padding.py) and `import flash_attn_interface` (FA3: fa3.py, also as `flash_attn_3.flash_attn_interface`)
resolve to tileflash, each with its own library's argument order (2.x and FA3 differ after the first three
arguments). Where a real flash-attn is installed, its other submodules (flash_attn.layers.rotary, ...) still import
from it. uninstall() puts back whatever those names held before. Modules that already did `from flash_attn import
...` keep the functions they hold. What flash-attn's package metadata answers (importlib.metadata, which
transformers' flash_attention_2 checks) does not change: use tileflash.integrations.transformers there."""
from __future__ import annotations

import importlib.machinery
import sys

from . import bert_padding, fa2, fa3

MODULES = {"flash_attn": fa2, "flash_attn.flash_attn_interface": fa2, "flash_attn.bert_padding": bert_padding,
           "flash_attn_interface": fa3, "flash_attn_3": fa3, "flash_attn_3.flash_attn_interface": fa3}
# attributes install() gives the modules, so `import flash_attn.bert_padding` and the like bind them
_ATTRIBUTES = ((fa2, "flash_attn_interface", fa2), (fa2, "bert_padding", bert_padding),
               (fa3, "flash_attn_interface", fa3))
_saved: dict = {}


def _real_package_path(name: str) -> list:
    """The submodule search path of an installed package `name` (found on sys.path, not in sys.modules), or []."""
    previous = sys.modules.get(name)
    if previous is not None and previous not in MODULES.values():
        return list(getattr(previous, "__path__", []))
    spec = importlib.machinery.PathFinder.find_spec(name)
    return list(spec.submodule_search_locations or []) if spec is not None else []


def install() -> None:
    """Register tileflash under flash-attn's module names (idempotent)."""
    if not _saved:
        fa2.__path__, fa3.__path__ = _real_package_path("flash_attn"), _real_package_path("flash_attn_3")
    for name, module in MODULES.items():
        if sys.modules.get(name) is not module:
            _saved.setdefault(name, sys.modules.get(name))
            sys.modules[name] = module
    for module, attr, value in _ATTRIBUTES:
        setattr(module, attr, value)


def uninstall() -> None:
    """Undo install(): the names hold what they held before it (or nothing)."""
    for name, previous in _saved.items():
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
    _saved.clear()
    for module, attr, _ in _ATTRIBUTES:
        module.__dict__.pop(attr, None)
    for module in (fa2, fa3):
        module.__dict__.pop("__path__", None)
