"""Import of user code named "package.module:name" (or "path/to/file.py:name") in a config key:
reward functions, tools, environments, tool-call parsers. Every failure is one UserError line
naming the key and the fix."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from typing import Any

from spmd_rl.errors import UserError


def import_object(spec: str, key: str, error: type[UserError] = UserError, kind: str = "function") -> Any:
    """The callable `spec` names; `key` is the config key that holds it (for the messages), `kind`
    what it should be ("function", "class")."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise error(f"{key} = {spec!r} must look like 'package.module:{kind}'")
    module = (_import_path(module_name, spec, key, error) if module_name.endswith(".py")
              else _import_module(module_name, spec, key, error))
    if not hasattr(module, attr):
        raise error(f"{key} = {spec!r}: module {module_name!r} has no attribute {attr!r}; check the {kind} name")
    obj = getattr(module, attr)
    if not callable(obj):
        raise error(f"{key} = {spec!r}: {attr!r} is a {type(obj).__name__}, not a {kind}")
    return obj


def _import_module(name: str, spec: str, key: str, error: type[UserError]):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise error(f"{key} = {spec!r}: module {name!r} not found; make it "
                        "importable (install it or add its directory to PYTHONPATH)") from None
        raise _import_failed(spec, name, e, key, error) from None
    except Exception as e:  # the user's module raised while importing (syntax error, missing file...)
        raise _import_failed(spec, name, e, key, error) from None


def _import_failed(spec: str, name: str, e: Exception, key: str, error: type[UserError]) -> UserError:
    """`name`: a module's dotted name, or the path of a .py file."""
    where = f" ({e.filename}, line {e.lineno})" if isinstance(e, SyntaxError) else ""
    if name.endswith(".py"):  # runpy runs the file as an import does (its __main__ block not)
        see = f'python -c "import runpy; runpy.run_path({name!r})"'
    else:
        see = f"python -c 'import {name}'"
    return error(f"{key} = {spec!r}: importing {name!r} failed with {type(e).__name__}: "
                 f"{e}{where}; run {see} to see the traceback")


def _import_path(path: str, spec: str, key: str, error: type[UserError]):
    if not os.path.isfile(path):
        raise error(f"{key} = {spec!r}: file {path!r} does not exist")
    name = "spmd_rl_user_" + re.sub(r"\W", "_", os.path.abspath(path))
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise _import_failed(spec, path, e, key, error) from None
    return module
