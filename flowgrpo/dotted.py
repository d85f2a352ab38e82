"""``"package.module:Name"`` paths, the way configs name user classes and registries name their
entries, imported on use."""
from __future__ import annotations

import importlib
from typing import Any


def import_dotted(path: str, what: str) -> Any:
    """The object at ``"package.module:Name"`` (``Outer.Inner`` allowed after the colon).
    ``what`` names it in the errors (e.g. "reward"): ValueError for a malformed path or a
    missing attribute, ImportError for a module that does not import."""
    module_name, _, qualname = path.partition(":")
    if not module_name or not qualname:
        raise ValueError(f"{what} class path must look like 'package.module:Class' (got {path!r})")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(f"cannot import module {module_name!r} for {what} {path!r}: "
                          f"{error}") from error
    for part in qualname.split("."):
        if not hasattr(target, part):
            raise ValueError(f"module {module_name!r} has no attribute {qualname!r} "
                             f"({what} {path!r})")
        target = getattr(target, part)
    return target
