"""Which ms-swift command this process runs, which frameworks it can import, and how ms-swift reads
its arguments.

Standard library only: the ``--plugin`` start-up hook (:mod:`.plugin_flag`) and the plugin itself
(:func:`elastic_moe_plugin.swift.install`, which does nothing in a command that does not train) both
ask, and the hook runs at interpreter start of ms-swift's processes, before anything else.
"""

from __future__ import annotations

import os
from typing import NamedTuple

#: ms-swift routes that train, whose arguments have ``--callbacks``; the others get only the file, and
#: the plugin does nothing in them (inference routes static top-k)
TRAINING_ROUTES = frozenset({"sft", "pt", "rlhf"})
#: files of ``swift/cli/`` that are not a route's entry script
_NOT_ROUTES = frozenset({"main", "utils", "__init__"})


class SwiftEntry(NamedTuple):
    """An ms-swift entry-script process: its route (``sft``, ...), whether it is Megatron-SWIFT's, and
    the directory of the ``swift`` package it runs from."""

    route: str
    megatron: bool
    swift_dir: str


def swift_entry(argv: list[str], orig_argv: list[str]) -> SwiftEntry | None:
    """The ms-swift entry script this process runs, or None for any other process.

    ``argv`` is ``sys.argv`` as the ``.pth`` sees it (``[script, args...]``, or ``['-m', args...]``
    before ``-m`` has resolved its module); ``orig_argv`` is ``sys.orig_argv``.
    """
    if not argv:
        return None
    if argv[0] == "-m":
        module = next((orig_argv[i + 1] for i, word in enumerate(orig_argv[:-1]) if word == "-m"), "")
        parts = module.split(".")
        if parts[:2] != ["swift", "cli"] or len(parts) not in (3, 4) or parts[-1] in _NOT_ROUTES:
            return None
        if len(parts) == 4 and parts[2] != "_megatron":
            return None
        import importlib.util

        try:
            spec = importlib.util.find_spec("swift")  # finds the package without importing it
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.submodule_search_locations:
            return None
        return SwiftEntry(parts[-1], len(parts) == 4, os.path.abspath(next(iter(spec.submodule_search_locations))))
    script = os.path.abspath(argv[0])
    head, name = os.path.split(script)
    route, ext = os.path.splitext(name)
    if ext != ".py" or route in _NOT_ROUTES:
        return None
    head, folder = os.path.split(head)
    megatron = folder == "_megatron"
    if megatron:
        head, folder = os.path.split(head)
    if folder != "cli":
        return None
    package = os.path.basename(head)
    if package != "swift" or not os.path.isfile(os.path.join(head, "cli", "main.py")):
        return None
    return SwiftEntry(route, megatron, head)


def importable(name: str) -> bool:
    """Whether module ``name`` can be imported, found without importing it (its parent packages are
    imported): the plugin patches and registers only for the frameworks this process has."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def argument_groups(argv: list[str]) -> list[tuple[str | None, list[str]]]:
    """Split arguments into ``(flag, values)`` groups, as ms-swift's parser reads them: a flag is a
    word starting with ``--`` (``--flag=value`` is the flag with one value); its values are the words
    up to the next flag. Words before the first flag form a group with flag None."""
    groups: list[tuple[str | None, list[str]]] = []
    for word in argv:
        if word.startswith("--") and len(word) > 2:
            flag, sep, value = word.partition("=")
            groups.append((flag, [value] if sep else []))
        elif groups:
            groups[-1][1].append(word)
        else:
            groups.append((None, [word]))
    return groups


__all__ = ["TRAINING_ROUTES", "SwiftEntry", "argument_groups", "importable", "swift_entry"]
