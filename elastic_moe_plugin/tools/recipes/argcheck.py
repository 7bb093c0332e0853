"""Check rendered recipe commands with the frameworks' own argument parsers, training nothing.

Each recipe is rendered for its own 2 x 8 cluster (what ``elastic-moe launch --dry-run`` prints);
its flags then go through ms-swift 4.6's ``HfArgumentParser`` of ``SftArguments`` /
``MegatronSftArguments`` (plus the checks that need no model), Megatron-LM's own parser and
``validate_args`` from the megatron-core wheel, or torchtitan 0.3's ``ConfigManager`` (its tyro
parser and its config's own checks; the model built on the meta device and its parameters counted).
Where a framework import cannot work on this machine (no triton, no Transformer Engine for
``mcore_bridge`` or no ``mcore_bridge`` at all, Python 3.11) a shim stands in; every shim used is
listed in the result. What is and is not checked: docs/recipes.md, "How the arguments were checked".

::

    python -m elastic_moe_plugin.tools.recipes.argcheck [RECIPE ...] [--json]     # default: every recipe
    elastic-moe recipes --check-args
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import sys
import traceback
import types
from collections.abc import Iterable
from typing import Any, NoReturn

from elastic_moe_plugin.core.import_hooks import IMPORT_HOOKS
from elastic_moe_plugin.tools.recipes.load import list_recipe_files, load_recipe
from elastic_moe_plugin.tools.recipes.recipe import Recipe
from elastic_moe_plugin.tools.recipes.render import framework_args, render
from elastic_moe_plugin.tools.recipes.topology import resolve_topology

#: len() of the Qwen3 tokenizer (151,643 BPE tokens + 26 special tokens) [external].
QWEN3_TOKENIZER_LENGTH = 151669


class _ParseError(Exception):
    pass


# ------------------------------------------------------------------------------------ shims
class _Stub:
    """Stands in for any mcore_bridge object at import time; raises if called."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} is an import stub (mcore_bridge is not installed); it cannot run")

    def __getattr__(self, name: str) -> _Stub:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(f"{self._name}.{name}")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(f"{self.__name__}.{name}")


def _serve_stubs(package: str) -> None:
    """Answer every import of ``package`` and its submodules with a :class:`_StubModule`, for the
    rest of the process, through the package's one import finder (ms-swift's argument module
    imports mcore_bridge only for dataclass definitions, which the stubs stand in for)."""

    def stub(name: str) -> _StubModule:
        module = _StubModule(name)
        module.__path__ = []
        return module

    IMPORT_HOOKS.serve(lambda name: name == package or name.startswith(package + "."), stub)


def _available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def install_import_shims() -> list[str]:
    """Make ms-swift's Megatron arguments and Megatron-LM's argument module importable here."""
    used = []
    if not _available("triton"):
        from elastic_moe_plugin import cpu_runtime

        cpu_runtime.disable_torch_compile()
        cpu_runtime.enable(force=True)
        used.append("cpu_runtime (stand-in for megatron-core's triton-only paged_stash module)")
    if not _available("mcore_bridge"):
        _serve_stubs("mcore_bridge")
        used.append("mcore_bridge import stub (raises if called; only dataclass definitions are used)")
    elif not _available("transformer_engine"):
        # the real mcore-bridge, as megatron sft imports it on CPU (Transformer Engine stand-in
        # scoped to mcore-bridge's module bodies; megatron-core still sees no TE)
        from elastic_moe_plugin.cpu_runtime import megatron_swift

        megatron_swift.enable(force=True)
        used.append("cpu_runtime.megatron_swift (mcore-bridge without Transformer Engine, as megatron sft on CPU)")
    import typing

    if not hasattr(typing, "override"):
        typing.override = lambda function: function  # type: ignore[attr-defined]  # 3.11's typing has none
        used.append("typing.override (Python 3.12) for megatron/training on 3.11")
    return used


def _strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    def error(message: str) -> NoReturn:
        raise _ParseError(message)

    # argparse exits on a bad argument and has no hook to raise instead: its error method is replaced
    parser.error = error  # type: ignore[method-assign]
    return parser


# ------------------------------------------------------------------------------------ ms-swift
class SwiftChecker:
    def __init__(self) -> None:
        from transformers import HfArgumentParser

        try:
            from swift.utils.utils import _patch_get_type_hints
        except ImportError:  # pragma: no cover - older/newer swift
            _patch_get_type_hints = contextlib.nullcontext
        from swift.arguments import SftArguments

        self.classes = {"swift_sft": SftArguments}
        with contextlib.redirect_stdout(sys.stderr):
            from swift.megatron.arguments import MegatronSftArguments
        self.classes["megatron_sft"] = MegatronSftArguments
        self.parsers = {}
        for launcher, cls in self.classes.items():
            with _patch_get_type_hints():
                self.parsers[launcher] = _strict(HfArgumentParser([cls]))

    def check(self, recipe: Recipe, argv: list[str]) -> list[str]:
        import os

        from elastic_moe_plugin.swift import CALLBACK_NAME, plugin_path
        from elastic_moe_plugin.swift.plugin_flag import rewrite

        checked = [f"{self.classes[recipe.launcher].__name__} parser (ms-swift)"]
        if "--plugin" in argv:
            # what the start-up hook does in ms-swift's entry process, before ms-swift parses
            argv = rewrite(argv, "sft").argv
            checked.append("--plugin elastic_moe rewritten as the start-up hook does")
        namespace, remaining = self.parsers[recipe.launcher].parse_known_args(argv)
        if remaining:
            raise _ParseError(f"{self.classes[recipe.launcher].__name__} does not accept: {remaining}")
        plugins = [os.path.realpath(path) for path in getattr(namespace, "external_plugins", [])]
        if os.path.realpath(plugin_path()) not in plugins:
            raise _ParseError(f"external_plugins={namespace.external_plugins} does not load the plugin {plugin_path()}")
        if CALLBACK_NAME not in (getattr(namespace, "callbacks", None) or []):
            raise _ParseError(
                f"callbacks={getattr(namespace, 'callbacks', None)} lacks {CALLBACK_NAME!r}: the run would "
                f"log no routing metric"
            )
        checked.append(f"external_plugins loads the plugin file; callbacks include {CALLBACK_NAME!r}")
        from swift.utils import json_parse_to_dict

        for key in ("megatron_extra_kwargs", "model_kwargs"):
            value = getattr(namespace, key, None)
            if value is not None:
                parsed = json_parse_to_dict(value)
                if not isinstance(parsed, dict):
                    raise _ParseError(f"--{key} {value!r} is not a JSON object")
                if key == "megatron_extra_kwargs":
                    from megatron.core.transformer.transformer_config import TransformerConfig

                    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
                    unknown = sorted(set(parsed) - fields)
                    if unknown:
                        raise _ParseError(f"megatron_extra_kwargs keys {unknown} are not TransformerConfig fields")
                    checked.append("megatron_extra_kwargs keys are TransformerConfig fields")
        if recipe.launcher == "swift_sft":
            probe = types.SimpleNamespace(**vars(namespace))
            try:
                self.classes["swift_sft"]._check_padding_free(probe)
            except ValueError as error:
                raise _ParseError(f"SftArguments._check_padding_free: {error}") from None
            checked.append("SftArguments._check_padding_free")
        return checked


# ------------------------------------------------------------------------------------ Megatron-LM
class MegatronLMChecker:
    def __init__(self) -> None:
        import torch

        torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)  # only validate_args asks
        with contextlib.redirect_stdout(sys.stderr):
            import megatron.training.arguments as arguments
            from megatron.training.vocab_utils import calculate_padded_vocab_size
        self.arguments = arguments
        self.padded = calculate_padded_vocab_size

    def check(self, recipe: Recipe, argv: list[str], world_size: int) -> list[str]:
        parser = _strict(self.arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
        namespace = parser.parse_args(argv)
        namespace.world_size, namespace.rank = world_size, 0
        with contextlib.redirect_stdout(sys.stderr):
            try:
                self.arguments.validate_args(namespace, {})
            except (AssertionError, ValueError) as error:
                frame = traceback.extract_tb(error.__traceback__)[-1]
                where = f"{frame.filename.rsplit('/megatron/', 1)[-1]}:{frame.lineno}: {frame.line}"
                raise _ParseError(f"megatron validate_args: {str(error) or 'assertion failed'} ({where})") from None
        padded = self.padded(
            QWEN3_TOKENIZER_LENGTH,
            namespace.make_vocab_size_divisible_by,
            namespace.tensor_model_parallel_size,
            logging_enabled=False,
        )
        if padded != recipe.model.vocab_size:
            raise _ParseError(
                f"Megatron pads a {QWEN3_TOKENIZER_LENGTH}-token vocabulary to {padded}, "
                f"not model.vocab_size={recipe.model.vocab_size}"
            )
        return [
            "megatron/training/arguments.py parser (megatron-core wheel), strict",
            f"validate_args with world_size={world_size}",
            f"padded vocab {QWEN3_TOKENIZER_LENGTH} -> {padded}",
        ]


# ------------------------------------------------------------------------------------ torchtitan
class TitanChecker:
    """torchtitan's own parsing of a rendered command (``ConfigManager.parse_args``: ``--module`` /
    ``--config`` resolved, every flag through tyro, the config's ``__post_init__`` checks), the door's
    ``--override.imports`` entry read as the door reads it, and the model ``--config`` builds (on the
    meta device) against the recipe's ``model:`` block."""

    def __init__(self) -> None:
        if not _available("torchtitan"):
            raise ImportError("No module named 'torchtitan'")
        if not _available("triton"):
            from elastic_moe_plugin.cpu_runtime import titan as titan_cpu_runtime

            titan_cpu_runtime.enable(force=True)  # MinimalAsyncEP's triton kernels, imported by torchtitan.train
        from torchtitan.config import ConfigManager

        self.manager = ConfigManager

    def check(self, recipe: Recipe, argv: list[str]) -> list[str]:
        import io

        import torch

        from elastic_moe_plugin.core.config import config_from_override
        from elastic_moe_plugin.tools.recipes import titan_models
        from elastic_moe_plugin.tools.recipes.render_titan import DOOR

        captured = io.StringIO()
        try:
            with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
                config = self.manager().parse_args(argv)
        except (SystemExit, ValueError, ImportError) as error:
            raise _ParseError(f"torchtitan ConfigManager: {captured.getvalue().strip() or error}") from None
        checked = ["torchtitan ConfigManager parser (tyro) and Trainer.Config checks"]
        entries = [entry for entry in config.override.imports if isinstance(entry, tuple) and entry[0] == DOOR]
        if len(entries) != 1 or config_from_override(entries[0][1], environ={}) != recipe.elastic:
            raise _ParseError(f"--override.imports {config.override.imports} does not carry the recipe's elastic block")
        checked.append(f"{DOOR} JSON = the recipe's ElasticConfig")
        with torch.device("meta"):
            model = config.model_spec.model.build()
        facts = recipe.model
        counts = titan_models.parameter_counts(model, facts.training_topk)
        expected = (facts.total_params(), int(facts.active_params(facts.training_topk)))
        if (counts["total"] - counts["norms"], counts["active"] - counts["norms"]) != expected:
            raise _ParseError(
                f"the model of --config {config.model_spec.flavor} has {counts} parameters, the recipe's model: block "
                f"{expected} (total, active) without norms"
            )
        checked.append(
            f"model {config.model_spec.flavor}: {counts['total']:,} parameters ({counts['active']:,} active at "
            f"top-{facts.training_topk}) = the model: block's {expected[0]:,} ({expected[1]:,}) + {counts['norms']:,} "
            "norm weights"
        )
        return checked


# ------------------------------------------------------------------------------------ driver
def check_recipes(paths: Iterable[str]) -> dict[str, Any]:
    shims = install_import_shims()
    results: dict[str, Any] = {"shims": shims, "recipes": {}}
    checkers: dict[str, Any] = {}
    for path in paths:
        recipe = load_recipe(path)
        topology = resolve_topology(recipe, environ={})
        command = render(recipe, topology)
        argv = framework_args(command)
        entry: dict[str, Any] = {"launcher": recipe.launcher, "argv": argv, "ok": False}
        kind = {"swift_sft": "swift", "megatron_sft": "swift", "torchtitan": "titan"}.get(recipe.launcher, "mlm")
        # both ways a command may load the plugin, whichever this environment renders
        forms = (
            [framework_args(render(recipe, topology, plugin_form=form)) for form in ("plugin", "path")]
            if kind == "swift"
            else [argv]
        )
        if kind not in checkers:
            try:
                checkers[kind] = {"swift": SwiftChecker, "titan": TitanChecker, "mlm": MegatronLMChecker}[kind]()
            except ImportError as error:
                checkers[kind] = error
        checker = checkers[kind]
        try:
            if isinstance(checker, ImportError):
                framework = {"swift": "ms-swift", "titan": "torchtitan", "mlm": "megatron/training"}[kind]
                entry["skipped"] = f"{framework} is not importable: {checker}"
            elif kind == "swift":
                entry["checked"] = []
                for form in forms:
                    entry["checked"] += [c for c in checker.check(recipe, form) if c not in entry["checked"]]
                entry["ok"] = True
            elif kind == "titan":
                entry["checked"] = checker.check(recipe, argv)
                entry["ok"] = True
            else:
                entry["checked"] = checker.check(recipe, argv, topology.world_size)
                entry["ok"] = True
        except _ParseError as error:
            entry["error"] = str(error)
        results["recipes"][f"{recipe.setting}/{recipe.name}"] = entry
    return results


def run_checks(recipes: Iterable[str] = (), *, as_json: bool = False) -> int:
    """Check ``recipes`` (files or names; default: every built-in recipe) and print the results,
    as JSON or one line per recipe. The frameworks' import-time chatter goes to stderr.

    Returns:
        0 when every recipe passed or was skipped (framework not importable), else 1.
    """
    paths = list(recipes) or [str(path) for _, path in list_recipe_files()]
    with contextlib.redirect_stdout(sys.stderr):
        results = check_recipes(paths)
    report = json.dumps(results, indent=1) if as_json else format_results(results)
    if report:
        print(report)
    return 0 if all(e["ok"] or "skipped" in e for e in results["recipes"].values()) else 1


def format_results(results: dict[str, Any]) -> str:
    """The text report of :func:`check_recipes`: the shims, then ``ok``/``SKIP``/``FAIL`` per recipe."""
    lines = [f"shim: {shim}" for shim in results["shims"]]
    for name, entry in results["recipes"].items():
        status = "ok  " if entry["ok"] else "SKIP" if "skipped" in entry else "FAIL"
        detail = "; ".join(entry["checked"]) if entry["ok"] else entry.get("skipped") or entry["error"]
        lines.append(f"{status} {name}: {detail}")
    return "\n".join(lines)


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(
        prog="python -m elastic_moe_plugin.tools.recipes.argcheck",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _parser.add_argument("recipes", nargs="*", help="recipe files (default: every recipe under configs/)")
    _parser.add_argument("--json", action="store_true")
    _args = _parser.parse_args()
    sys.exit(run_checks(_args.recipes, as_json=_args.json))
