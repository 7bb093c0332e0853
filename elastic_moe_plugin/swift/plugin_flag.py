"""``--plugin elastic_moe`` for ``swift sft`` / ``megatron sft``: a start-up hook that rewrites a plugin
*name* into the flags ms-swift 4.6 understands.

ms-swift has no ``--plugin`` flag; its one hook is ``--external_plugins FILE`` (a path, imported on
every rank by ``BaseArguments.__post_init__``), and the routing metrics need ``--callbacks
elastic_moe`` as well. The wheel installs one ``.pth`` file (``elastic-moe-swift.pth``) at the
root of site-packages, which Python's ``site`` module executes at every interpreter start. Its
single line compares strings of ``sys.argv[0]`` / ``sys.orig_argv`` (no import) and imports this
module only in a process that runs a script under ``swift/cli/`` or ``-m swift.cli.*`` (any other
script whose path merely contains "swift" pays nothing); :func:`activate` then acts only in
the processes that ms-swift's launchers start to do the work, i.e. the ms-swift entry scripts::

    python <site-packages>/swift/cli/sft.py ARGS...            # `swift sft`'s child
    python <site-packages>/swift/cli/_megatron/sft.py ARGS...  # `megatron sft`'s child
    python -u <site-packages>/swift/cli/sft.py ARGS...         # each torchrun worker (NPROC_PER_NODE)
    python -m swift.cli.sft ARGS...                             # by hand

``swift sft`` and ``megatron sft`` themselves only re-launch one of those (after expanding a YAML
config into flags), so acting in the entry script covers the YAML form and every rank, and the
launcher process is left alone. There the hook rewrites ``sys.argv`` in place, before ms-swift has
imported anything::

    --plugin elastic_moe            ->  --external_plugins <the packaged plugin file> --callbacks elastic_moe
    --plugin=elastic_moe            ->  the same
    --external_plugins elastic_moe  ->  the same (a plugin name where ms-swift expects a path)

merging into an ``--external_plugins`` / ``--callbacks`` the command already has (ms-swift keeps the
last occurrence of a list flag, so that is the one extended). ``--callbacks`` is added only for the
training routes (``sft``, ``pt``, ``rlhf``), the ones whose arguments have it. Everything else,
including ms-swift's own re-import of ``external_plugins`` from a checkpoint's ``args.json``, is
ms-swift's unchanged mechanism.

It steps aside when

- ``ELASTIC_MOE_SWIFT_HOOK=0`` (the off switch): then ``--plugin`` reaches ms-swift, which rejects it;
- the installed ms-swift declares an argument whose name starts with ``plugin`` or discovers
  plugins through entry points (:func:`swift_handles_plugins`): then ms-swift owns ``--plugin``.

An unknown plugin name stops the process with exit status 2 and a message listing the known ones.
It also warns, on rank 0 of a training route, when ``ELASTIC_MOE_*`` variables are set but no
elastic-moe plugin is loaded (such a run would train plain top-k and exit 0).

This module imports only the standard library and the package's light modules (``__init__``,
:mod:`.entry`, :mod:`.names`; no torch): in a non-swift process the ``.pth`` line imports nothing at
all.
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

from elastic_moe_plugin.swift.entry import TRAINING_ROUTES, SwiftEntry, argument_groups, swift_entry

# Plain classes and NamedTuples, no dataclasses or regular expressions at module level: this module
# is imported at interpreter start of ms-swift's processes, before anything else, and those imports
# (dataclasses pulls in inspect, dis, ...) would be paid first here.

#: ``ELASTIC_MOE_SWIFT_HOOK=0`` turns the hook off (then ms-swift sees ``--plugin`` as typed)
OFF_SWITCH = "ELASTIC_MOE_SWIFT_HOOK"
_OFF_VALUES = {"0", "false", "no", "off"}
#: the file the wheel installs at the root of site-packages (``_build_hooks.py``)
PTH_NAME = "elastic-moe-swift.pth"
#: the flag this hook adds to ms-swift
PLUGIN_FLAG = "--plugin"
EXTERNAL_PLUGINS_FLAG = "--external_plugins"
CALLBACKS_FLAG = "--callbacks"
#: where ms-swift 4.6 declares its arguments and loads plugin files: a future ``--plugin`` or
#: plugin registry would most likely appear here (relative to the ``swift`` package directory)
_SWIFT_PLUGIN_SOURCES = ("arguments/base_args/base_args.py", "megatron/arguments/megatron_args.py", "utils/utils.py")
_PLUGIN_FIELD = r"^[ \t]+(plugin\w*)[ \t]*:"
_ENTRY_POINTS = r"entry_points\("


class PluginFlagError(ValueError):
    """A ``--plugin`` / ``--external_plugins`` value that names no plugin; the message lists the known ones."""


class SwiftPlugin(NamedTuple):
    """A plugin ``--plugin NAME`` can load: the file ms-swift imports and the callbacks it registers."""

    name: str
    file: str
    callbacks: tuple[str, ...]
    description: str


def known_plugins() -> dict[str, SwiftPlugin]:
    """``{name: SwiftPlugin}`` of the plugins this package ships (one today)."""
    from elastic_moe_plugin.swift.names import CALLBACK_NAME, PLUGIN_FILE

    return {
        "elastic_moe": SwiftPlugin(
            name="elastic_moe",
            file=str(PLUGIN_FILE),
            callbacks=(CALLBACK_NAME,),
            description="Elastic Expert Routing (elastic-moe-plugin): per-token expert budgets in training",
        )
    }


def swift_handles_plugins(swift_dir: str) -> str | None:
    """Why the installed ms-swift needs no help with ``--plugin`` (a sentence), or None.

    Read from its source, without importing it: an argument field whose name starts with
    ``plugin`` (argparse would then accept ``--plugin``, even as an abbreviation), or plugin
    discovery through ``importlib.metadata.entry_points``, in the files where ms-swift 4.6 keeps
    its arguments and its plugin loader.
    """
    import re

    for relative in _SWIFT_PLUGIN_SOURCES:
        path = os.path.join(swift_dir, relative)
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except OSError:
            continue
        match = re.search(_PLUGIN_FIELD, text, re.MULTILINE)
        if match:
            return f"ms-swift declares its own argument {match.group(1)!r} ({path})"
        if re.search(_ENTRY_POINTS, text):
            return f"ms-swift discovers plugins through entry points ({path})"
    return None


# ---------------------------------------------------------------------------------- rewriting
class Rewrite(NamedTuple):
    """The result of :func:`rewrite`: the new arguments, and the plugins given by name
    (``--plugin NAME`` or ``--external_plugins NAME``); none means nothing changed."""

    argv: list[str]
    named: list[SwiftPlugin]

    @property
    def changed(self) -> bool:
        return bool(self.named)


def _unknown(name: str, known: dict[str, SwiftPlugin], how: str) -> PluginFlagError:
    listing = "; ".join(f"{plugin.name} ({plugin.description})" for plugin in known.values())
    return PluginFlagError(
        f"{how} {name!r}: no such plugin. Known plugins: {listing}. Pass one of those names "
        f"(e.g. --plugin {next(iter(known))}), or a plugin file with --external_plugins PATH."
    )


def _looks_like_name(value: str) -> bool:
    return os.sep not in value and "/" not in value and not value.endswith(".py")


def rewrite(argv: list[str], route: str, *, known: dict[str, SwiftPlugin] | None = None) -> Rewrite:
    """Turn the plugin names of ``argv`` (the arguments after the script) into ms-swift's flags.

    Raises:
        PluginFlagError: a ``--plugin`` value, or an ``--external_plugins`` value that is neither a
            file nor a plugin name, names no known plugin; or ``--plugin`` has no value.
    """
    known = known_plugins() if known is None else known
    named: list[SwiftPlugin] = []
    kept, first_plugin_group = _take_plugin_flags(argument_groups(argv), known, named)
    # ms-swift keeps the last occurrence of a list flag: extend that one
    last = {flag: index for index, (flag, _) in enumerate(kept) if flag in (EXTERNAL_PLUGINS_FLAG, CALLBACKS_FLAG)}
    if EXTERNAL_PLUGINS_FLAG in last:
        _replace_plugin_names(kept[last[EXTERNAL_PLUGINS_FLAG]][1], known, named)
    if not named:
        return Rewrite(argv=list(argv), named=[])
    _add_flags(kept, last, first_plugin_group, named, route)
    new_argv = [word for flag, values in kept for word in ([flag] if flag else []) + values]
    return Rewrite(argv=new_argv, named=named)


def _add_named(named: list[SwiftPlugin], plugin: SwiftPlugin) -> None:
    if plugin not in named:
        named.append(plugin)


def _take_plugin_flags(
    groups: list[tuple[str | None, list[str]]], known: dict[str, SwiftPlugin], named: list[SwiftPlugin]
) -> tuple[list[tuple[str | None, list[str]]], int | None]:
    """The groups other than ``--plugin`` (copies), and where the first ``--plugin`` stood among them
    (None: there was none); the plugins those flags name are added to ``named``."""
    first_plugin_group = None
    kept: list[tuple[str | None, list[str]]] = []
    for flag, values in groups:
        if flag == PLUGIN_FLAG:
            if not values:
                raise PluginFlagError(
                    f"{PLUGIN_FLAG} needs a plugin name, e.g. {PLUGIN_FLAG} {next(iter(known))}. "
                    f"Known plugins: {', '.join(known)}."
                )
            for value in values:
                if value not in known:
                    raise _unknown(value, known, PLUGIN_FLAG)
                _add_named(named, known[value])
            if first_plugin_group is None:
                first_plugin_group = len(kept)
            continue
        kept.append((flag, list(values)))
    return kept, first_plugin_group


def _replace_plugin_names(values: list[str], known: dict[str, SwiftPlugin], named: list[SwiftPlugin]) -> None:
    """In the values of an ``--external_plugins``, replace each plugin name by the plugin's file (added
    to ``named``); a file stays as it is."""
    for position, value in enumerate(values):
        if os.path.isfile(value):
            continue
        if value in known:
            _add_named(named, known[value])
            values[position] = known[value].file
        elif _looks_like_name(value):
            raise _unknown(value, known, EXTERNAL_PLUGINS_FLAG)


def _add_flags(
    kept: list[tuple[str | None, list[str]]],
    last: dict[str, int],
    first_plugin_group: int | None,
    named: list[SwiftPlugin],
    route: str,
) -> None:
    """Put the files of ``named`` into the last ``--external_plugins`` of ``kept`` (a new one where the
    first ``--plugin`` stood, else at the end) and, on a training route, their callbacks into the last
    ``--callbacks`` (a new one right after it); ``last`` holds where those flags are in ``kept``."""
    files = [plugin.file for plugin in named]
    if EXTERNAL_PLUGINS_FLAG in last:
        values = kept[last[EXTERNAL_PLUGINS_FLAG]][1]
        present = {os.path.realpath(value) for value in values}
        values += [file for file in files if os.path.realpath(file) not in present]
        values[:] = list(dict.fromkeys(values))
    else:
        at = len(kept) if first_plugin_group is None else first_plugin_group
        kept.insert(at, (EXTERNAL_PLUGINS_FLAG, files))
        last = {flag: index + (index >= at) for flag, index in last.items()}
        last[EXTERNAL_PLUGINS_FLAG] = at
    callbacks = [name for plugin in named for name in plugin.callbacks]
    if route in TRAINING_ROUTES and callbacks:
        if CALLBACKS_FLAG in last:
            values = kept[last[CALLBACKS_FLAG]][1]
            values += [name for name in callbacks if name not in values]
        else:
            kept.insert(last[EXTERNAL_PLUGINS_FLAG] + 1, (CALLBACKS_FLAG, callbacks))


# ---------------------------------------------------------------------------------- the hook
def hook_installed(environ=None) -> bool:
    """Whether ``--plugin`` works for ms-swift run from this interpreter's environment: the ``.pth``
    is in one of its site-packages directories (a wheel install; an editable install of a checkout
    has none) and :data:`OFF_SWITCH` is not set."""
    import site
    import sysconfig

    environ = os.environ if environ is None else environ
    if environ.get(OFF_SWITCH, "").strip().lower() in _OFF_VALUES:
        return False
    directories = {sysconfig.get_paths()["purelib"], *getattr(site, "getsitepackages", lambda: [])()}
    return any(os.path.isfile(os.path.join(directory, PTH_NAME)) for directory in directories)


def loads_elastic_moe(argv: list[str]) -> bool:
    """Whether the ``--external_plugins`` ms-swift will use (the last one) loads an elastic-moe plugin
    file: the packaged one, or any file that imports ``elastic_moe_plugin`` (``patches/elastic_moe.py``
    of a checkout, a user's own plugin)."""
    from elastic_moe_plugin.swift.names import PLUGIN_FILE

    values = next((values for flag, values in reversed(argument_groups(argv)) if flag == EXTERNAL_PLUGINS_FLAG), [])
    ours = os.path.realpath(PLUGIN_FILE)
    for value in values:
        if os.path.realpath(value) == ours:
            return True
        try:
            with open(value, encoding="utf-8", errors="replace") as handle:
                if "elastic_moe_plugin" in handle.read():
                    return True
        except OSError:
            continue
    return False


def _is_rank_zero(environ) -> bool:
    return environ.get("RANK", "0") == "0" and environ.get("LOCAL_RANK", "0") == "0"


def _say(message: str) -> None:
    sys.stderr.write(f"elastic-moe: {message}\n")
    sys.stderr.flush()


def elastic_moe_variables(environ) -> list[str]:
    """The ``ELASTIC_MOE_*`` variables that configure the plugin (the off switch excepted)."""
    return sorted(key for key in environ if key.startswith("ELASTIC_MOE_") and key != OFF_SWITCH)


_ACTIVATED = False


def activate() -> None:
    """Called by the ``.pth`` line at interpreter start: rewrite ``sys.argv`` of an ms-swift entry
    script (module docstring). Runs at most once per process (site may process the ``.pth`` twice,
    e.g. through a venv's ``lib64`` link)."""
    global _ACTIVATED
    if _ACTIVATED:
        return
    _ACTIVATED = True
    environ = os.environ
    if environ.get(OFF_SWITCH, "").strip().lower() in _OFF_VALUES:
        return
    entry = swift_entry(sys.argv, list(getattr(sys, "orig_argv", [])))
    if entry is None:
        return
    arguments = sys.argv[1:]
    mentions_plugins = any(word.startswith((PLUGIN_FLAG, EXTERNAL_PLUGINS_FLAG)) for word in arguments)
    variables = elastic_moe_variables(environ)
    if not mentions_plugins and not variables:
        return
    deferred_to = swift_handles_plugins(entry.swift_dir)
    if deferred_to is not None:
        if _is_rank_zero(environ) and PLUGIN_FLAG in [word.partition("=")[0] for word in arguments]:
            _say(f"{deferred_to}: leaving --plugin to ms-swift (the start-up hook of elastic-moe-plugin stands aside).")
        return
    try:
        result = rewrite(arguments, entry.route)
    except PluginFlagError as error:
        if environ.get("LOCAL_RANK", "0") == "0":
            _say(f"error: {error}")
        # Raising SystemExit while `site` runs .pth files is a fatal interpreter error; nothing has
        # run yet, so leave directly, with argparse's usage-error status.
        os._exit(2)
    if result.changed:
        sys.argv[1:] = result.argv
        if _is_rank_zero(environ):
            added = " ".join(
                word
                for flag, values in argument_groups(result.argv)
                if flag in (EXTERNAL_PLUGINS_FLAG, CALLBACKS_FLAG)
                for word in [flag, *values]
            )
            names = ", ".join(plugin.name for plugin in result.named)
            _say(
                f"plugin {names}: passing it to ms-swift as {added} (ms-swift has no --plugin flag; "
                f"{OFF_SWITCH}=0 turns this off)."
            )
    # training routes only: infer/export re-import the plugins saved in a checkpoint's args.json
    if variables and entry.route in TRAINING_ROUTES and not loads_elastic_moe(sys.argv[1:]) and _is_rank_zero(environ):
        _say(
            f"WARNING: {', '.join(variables)} set, but no elastic-moe plugin is loaded: this run trains plain "
            f'top-k and ignores them. Add --plugin elastic_moe (or --external_plugins "$(elastic-moe plugin-path)" '
            f"--callbacks elastic_moe), or unset the variables."
        )


__all__ = [
    "OFF_SWITCH",
    "PTH_NAME",
    "TRAINING_ROUTES",
    "PluginFlagError",
    "Rewrite",
    "SwiftEntry",
    "SwiftPlugin",
    "activate",
    "argument_groups",
    "hook_installed",
    "known_plugins",
    "loads_elastic_moe",
    "rewrite",
    "swift_entry",
    "swift_handles_plugins",
]
