"""flash-attn's module names on tileflash, for code that imports flash-attn and should run unchanged:

    import tileflash.integrations.flash_attn as tf_compat
    tf_compat.install()         # once, before the code that imports flash_attn / flash_attn_interface

after which `import flash_attn` (2.x: fa2.py, also as `flash_attn.flash_attn_interface`), `flash_attn.bert_padding`
(bert_padding.py) and `import flash_attn_interface` (FA3: fa3.py) resolve to tileflash, each with its own library's
argument order (2.x and FA3 differ after the first three arguments). uninstall() puts back whatever those names
held before. Modules that already did `from flash_attn import ...` keep the functions they hold."""
from __future__ import annotations

import sys

from . import bert_padding, fa2, fa3

MODULES = {"flash_attn": fa2, "flash_attn.flash_attn_interface": fa2, "flash_attn.bert_padding": bert_padding,
           "flash_attn_interface": fa3}
_saved: dict = {}


def install() -> None:
    """Register tileflash under flash-attn's module names (idempotent)."""
    for name, module in MODULES.items():
        if sys.modules.get(name) is not module:
            _saved.setdefault(name, sys.modules.get(name))
            sys.modules[name] = module
    fa2.flash_attn_interface, fa2.bert_padding = fa2, bert_padding  # `import flash_attn.bert_padding` binds these


def uninstall() -> None:
    """Undo install(): the names hold what they held before it (or nothing)."""
    for name, previous in _saved.items():
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
    _saved.clear()
