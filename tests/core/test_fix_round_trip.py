"""Every suggested fix, in every entry point's spelling, is accepted by the model the message was about.

Each case is a bad setting and a model (top-k, routed experts, decoder layers). It goes through
every entry point that can express it, as a user types it there:

- ``python``: ``ElasticConfig.from_dict(kwargs, model=...)`` (Python values, ``schedule='6-10'``);
- ``env``: ``ElasticConfig.from_env(environ, model=...)`` (``ELASTIC_MOE_SCHEDULE=6-10``, as the ms-swift
  plugin reads it with the model's config.json);
- ``yaml``: ``ElasticConfig.from_yaml(path, model=...)`` (``schedule: 6-10``);
- ``cli``: ``--elastic-moe-*`` flags of :func:`add_cli_arguments` through :func:`config_from_cli`;
- ``megatron_lm``: ``python -m elastic_moe_plugin.megatron_lm``'s ``parse_argv`` and the check before the
  script runs (:func:`check_megatron_args`), the model given as Megatron-LM flags
  (``--num-experts``, ``--moe-router-topk``, ``--num-layers``);
- ``schedule_cli``: ``elastic-moe schedule SPEC --center K --experts E [--sigma S] [--allow-off-center]``.

For every refusal the test requires: at least one fix; each fix of ``error.fixes`` written in the
message in the entry point's spelling; every setting-shaped text in the message (found by a
pattern of that spelling, not by the renderer) either the refused input as typed or part of a
declared fix; and each fix, parsed back from the message's text by this test's own parser and
applied through the same entry point (renaming an unknown name first), accepted by the same model.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import shlex
from typing import Any

import pytest
import yaml

from elastic_moe_plugin import ConfigError
from elastic_moe_plugin.core.config import ElasticConfig, ModelShape, add_cli_arguments, config_from_cli
from elastic_moe_plugin.core.spelling import Spelling

FIELDS = ElasticConfig.field_names()
ENTRIES = ("python", "env", "yaml", "cli", "megatron_lm", "schedule_cli")
#: a value in a message: not prose after the name (a parenthesis), up to a space; commas are part of
#: a layers spec, and a trailing comma or full stop is the sentence's
_VALUE = r"(?!\()('[^']*'|[^\s;:)]+)"

TOP1 = ModelShape(1, 8, 2)
TOP2 = ModelShape(2, 8, 2)
TOP4 = ModelShape(4, 8, 4)
TOP8 = ModelShape(8, 64, 16)
TOP8_OF_8 = ModelShape(8, 8, 2)
TOP8_OF_10 = ModelShape(8, 10, 4)


@dataclasses.dataclass(frozen=True)
class Case:
    """A bad input: ``text`` as typed in the text entry points, ``python`` where Python values differ
    (default: the text), the model, and a phrase the message must hold."""

    text: dict[str, str]
    model: ModelShape
    says: str
    python: dict[str, Any] | None = None
    entries: tuple[str, ...] = ENTRIES

    def python_values(self) -> dict[str, Any]:
        return dict(self.text if self.python is None else self.python)


NO_CLI = tuple(e for e in ENTRIES if e != "cli")  # argparse itself refuses an unknown flag there

CASES: dict[str, Case] = {
    # ---------------------------------------------------------------- centre mismatches
    "center 4, default schedule, top-8": Case({"center": "4"}, TOP8, "routes to top-8", {"center": 4}),
    "center 5, 3-7, top-8": Case({"center": "5", "schedule": "3-7"}, TOP8, "routes to top-8", {"center": 5, "schedule": "3-7"}),
    "center 8, default schedule, top-2": Case({"center": "8"}, TOP2, "routes to top-2", {"center": 8}),
    "center 2, 1-3, top-4": Case({"center": "2", "schedule": "1-3"}, TOP4, "routes to top-4", {"center": 2, "schedule": "1-3"}),
    "center 4, static, top-8": Case({"center": "4", "schedule": "static"}, TOP8, "routes to top-8", {"center": 4, "schedule": "static"}),
    "center 4, point mass 4, top-8": Case({"center": "4", "schedule": "4"}, TOP8, "routes to top-8", {"center": 4, "schedule": "4"}),
    "center 6, 6-10, top-8": Case({"center": "6", "schedule": "6-10"}, TOP8, "routes to top-8", {"center": 6, "schedule": "6-10"}),
    "6-10 on top-2": Case({"schedule": "6-10"}, TOP2, "does not contain the model's top-2"),
    "6-10 on top-4": Case({"schedule": "6-10"}, TOP4, "does not contain the model's top-4"),
    "1-3 on top-8": Case({"schedule": "1-3"}, TOP8, "does not contain the model's top-8"),
    "3-5 on top-2": Case({"schedule": "3-5"}, TOP2, "does not contain the model's top-2"),
    "point mass 9 on top-8": Case({"schedule": "9"}, TOP8, "point mass at 9"),
    "point mass 2 on top-4": Case({"schedule": "2"}, TOP4, "point mass at 2"),
    # ---------------------------------------------------------------- off-centre and too wide
    "7-12 on top-8": Case({"schedule": "7-12"}, TOP8, "has mean"),
    "1-4 on top-2": Case({"schedule": "1-4"}, TOP2, "has mean"),
    "3-6 on top-4": Case({"schedule": "3-6"}, TOP4, "has mean"),
    "balanced 7-10 off centre": Case({"schedule": "7-10", "allow_off_center": "1", "sampling": "balanced"}, TOP8,
                                     "needs a schedule symmetric", {"schedule": "7-10", "allow_off_center": True,
                                                                    "sampling": "balanced"}),
    "6-10 on 8 experts": Case({"schedule": "6-10"}, TOP8_OF_8, "only 8 experts"),
    "5-11 on 10 experts": Case({"schedule": "5-11"}, TOP8_OF_10, "only 10 experts"),
    "1-15 on top-2 of 8": Case({"schedule": "1-15"}, TOP2, "only 8 experts"),
    # ---------------------------------------------------------------- low = 0 and reversed ranges
    "0-16 on top-8": Case({"schedule": "0-16"}, TOP8, "low=0"),
    "0-16 on top-2": Case({"schedule": "0-16"}, TOP2, "low=0"),
    "0-4 on top-2": Case({"schedule": "0-4"}, TOP2, "low=0"),
    "0-2 on top-1": Case({"schedule": "0-2"}, TOP1, "low=0"),
    "0-8 on top-4": Case({"schedule": "0-8"}, TOP4, "low=0"),
    "point mass 0": Case({"schedule": "0"}, TOP2, "at least one expert"),
    "9-7 on top-8": Case({"schedule": "9-7"}, TOP8, "low=9 > high=7"),
    "9-7 on top-2": Case({"schedule": "9-7"}, TOP2, "low=9 > high=7"),
    "11-5 on top-8": Case({"schedule": "11-5"}, TOP8, "low=11 > high=5"),
    "3-1 on top-2": Case({"schedule": "3-1"}, TOP2, "low=3 > high=1"),
    "10-6 on top-4": Case({"schedule": "10-6"}, TOP4, "low=10 > high=6"),
    # ---------------------------------------------------------------- no range from the model
    "default on top-1": Case({}, TOP1, "no elastic schedule can be resolved"),
    "auto on top-1": Case({"schedule": "auto"}, TOP1, "no elastic schedule can be resolved"),
    "default on top-8 of 8": Case({}, TOP8_OF_8, "no budget above 8"),
    # ---------------------------------------------------------------- unparsable
    "six-ten": Case({"schedule": "six-ten"}, TOP8, "does not parse"),
    "6..10": Case({"schedule": "6..10"}, TOP8, "does not parse"),
    "empty schedule": Case({"schedule": ""}, TOP8, "is invalid", entries=("python", "env", "yaml", "cli", "megatron_lm")),
    # ---------------------------------------------------------------- layers
    "layers 7-3 reversed": Case({"layers": "7-3"}, TOP8, "reversed range"),
    "layers 7-3 reversed, 6 layers": Case({"layers": "7-3"}, ModelShape(8, 64, 6), "reversed range"),
    "layers 3-7 on 6 layers": Case({"layers": "3-7"}, ModelShape(8, 64, 6), "selects layer(s) [6, 7]"),
    "layers 16 on 16 layers": Case({"layers": "16"}, TOP8, "selects layer(s) [16]"),
    "layers 0,2,5-7 on 4 layers": Case({"layers": "0,2,5-7"}, ModelShape(8, 64, 4), "selects layer(s) [5, 6, 7]"),
    "layers 2-9 on 4 layers": Case({"layers": "2-9"}, TOP4, "selects layer(s)"),
    "layers none": Case({"layers": "none"}, TOP8, "is ambiguous"),
    "layers None (capitalised)": Case({"layers": "None"}, TOP8, "is ambiguous"),
    "layers L3-L7": Case({"layers": "L3-L7"}, TOP8, "is malformed"),
    "layers 3-": Case({"layers": "3-"}, TOP8, "is malformed"),
    "layers 1,,2": Case({"layers": "1,,2"}, TOP8, "is malformed"),
    "layers 3..7": Case({"layers": "3..7"}, TOP8, "is malformed"),
    # ---------------------------------------------------------------- sigma 0 and other numbers
    "sigma 0": Case({"sigma": "0"}, TOP8, "is invalid", {"sigma": 0}),
    "sigma -1": Case({"sigma": "-1"}, TOP8, "is invalid", {"sigma": -1.0}),
    "sigma nan": Case({"sigma": "nan"}, TOP8, "is invalid", {"sigma": float("nan")}),
    "sigma wide": Case({"sigma": "wide"}, TOP8, "is invalid"),
    "top_p 0": Case({"mode": "top_p", "top_p": "0"}, TOP8, "is invalid", {"mode": "top_p", "top_p": 0.0}),
    "top_p 1.5": Case({"top_p": "1.5"}, TOP8, "is invalid", {"top_p": 1.5}),
    "top_p high": Case({"top_p": "high"}, TOP8, "is invalid"),
    "top-p cap above the experts": Case({"mode": "top_p", "top_p_max_experts": "100"}, TOP8, "exceeds",
                                        {"mode": "top_p", "top_p_max_experts": 100}),
    "top-p cap 0": Case({"top_p_max_experts": "0"}, TOP8, "is invalid", {"top_p_max_experts": 0}),
    "top-p cap many": Case({"top_p_max_experts": "many"}, TOP8, "is invalid"),
    "center 0": Case({"center": "0"}, TOP8, "is invalid", {"center": 0}),
    "center eight": Case({"center": "eight"}, TOP8, "is invalid"),
    # ---------------------------------------------------------------- unknown choices
    "mode nucleus": Case({"mode": "nucleus"}, TOP8, "not a router mode"),
    "gate softmax": Case({"gate": "softmax"}, TOP8, "not a gate convention"),
    "sampling stratified": Case({"sampling": "stratified"}, TOP8, "not a sampling mode"),
    "log_metrics verbose": Case({"log_metrics": "verbose"}, TOP8, "not a metrics layout"),
    "log_metrics per-layer": Case({"log_metrics": "per-layer", "schedule": "6-10"}, TOP8, "not a metrics layout"),
    # ---------------------------------------------------------------- bad booleans
    "enabled maybe": Case({"enabled": "maybe"}, TOP8, "is"),
    "enabled 2": Case({"enabled": "2"}, TOP8, "is", {"enabled": 2}),
    "allow_off_center perhaps": Case({"allow_off_center": "perhaps"}, TOP8, "is"),
    # ---------------------------------------------------------------- unknown names
    "unknown schedul": Case({"schedul": "1-3"}, TOP2, "did you mean", entries=NO_CLI[:-1]),
    "unknown sigmaa": Case({"sigmaa": "1.0"}, TOP8, "did you mean", {"sigmaa": 1.0}, entries=NO_CLI[:-1]),
    "unknown layer": Case({"layer": "3-7"}, TOP8, "did you mean", entries=NO_CLI[:-1]),
    "unknown sampeling": Case({"sampeling": "iid"}, TOP8, "did you mean", entries=NO_CLI[:-1]),
}
assert len(CASES) >= 60


# ==================================================================================== entry points
class Entry:
    """One entry point: its input built from a case, how it runs, how a fix's text is applied."""

    spelling: Spelling

    def __init__(self, case: Case, tmp_path) -> None:
        self.case, self.tmp_path = case, tmp_path

    def run(self) -> None:  # raises ConfigError on refusal
        raise NotImplementedError

    def apply(self, text: str) -> None:
        raise NotImplementedError

    def rename(self, old: str, new: str) -> None:
        raise NotImplementedError

    #: pattern of a setting in this spelling: groups (name, value)
    pattern: re.Pattern

    def setting_name(self, written: str) -> str:
        return written

    def unquote(self, text: str) -> Any:
        """The text a shell hands over for ``text`` (one word)."""
        words = shlex.split(text)
        return words[0] if len(words) == 1 else text

    def parse_value(self, name: str, text: str) -> Any:
        """The field's value from its text (the same words every text entry point accepts), or the
        unquoted text where it means no value."""
        from elastic_moe_plugin.core.config import parse_text

        unquoted = self.unquote(text)
        if not isinstance(unquoted, str):
            return unquoted
        try:
            return parse_text(name, unquoted, Spelling("env"))
        except Exception:  # noqa: BLE001 - an unreadable value stands for itself
            return unquoted


class PythonEntry(Entry):
    spelling = Spelling("python")
    pattern = re.compile(r"\b(" + "|".join(sorted(FIELDS, key=len, reverse=True)) + r")=('[^']*'|None|True|False|nan|-?[0-9.]+)")

    def __init__(self, case, tmp_path):
        super().__init__(case, tmp_path)
        self.values = case.python_values()

    def run(self):
        ElasticConfig.from_dict(self.values, model=self.case.model)

    def apply(self, text):
        name, _, value = text.partition("=")
        self.values[name] = ast.literal_eval(value)

    def rename(self, old, new):
        self.values[new] = self.values.pop(old)

    def parse_value(self, name, text):
        return float("nan") if text == "nan" else ast.literal_eval(text)

    def unquote(self, text):
        return self.parse_value("", text)


class EnvEntry(Entry):
    spelling = Spelling("env")
    pattern = re.compile(r"\b(ELASTIC_MOE_[A-Z_]+)=('[^']*'|[^\s;:)]*)")

    def __init__(self, case, tmp_path):
        super().__init__(case, tmp_path)
        self.environ = {"ELASTIC_MOE_" + name.upper(): value for name, value in case.text.items()}

    def run(self):
        ElasticConfig.from_env(self.environ, model=self.case.model)

    def apply(self, text):
        [word] = shlex.split(text)
        variable, _, value = word.partition("=")
        self.environ[variable] = value

    def rename(self, old, new):
        self.environ[new] = self.environ.pop(old)

    def setting_name(self, written):
        return written.removeprefix("ELASTIC_MOE_").lower()


class YamlEntry(Entry):
    spelling = Spelling("yaml")
    # not the prose "is not a router mode: expected one of ..."
    pattern = re.compile(r"(?<![\w.])(" + "|".join(sorted(FIELDS, key=len, reverse=True)) + r"): (?!expected )" + _VALUE)

    def __init__(self, case, tmp_path):
        super().__init__(case, tmp_path)
        self.lines = {name: f"{name}: {_yaml_text(value)}" for name, value in case.text.items()}

    def run(self):
        path = self.tmp_path / "elastic.yaml"
        path.write_text("".join(line + "\n" for line in self.lines.values()))
        ElasticConfig.from_yaml(path, model=self.case.model)

    def apply(self, text):
        [(name, _)] = yaml.safe_load(text).items()
        self.lines[name] = text

    def rename(self, old, new):
        self.lines[new] = self.lines.pop(old).replace(old, new, 1)

    def unquote(self, text):
        return yaml.safe_load(text)


class CliEntry(Entry):
    spelling = Spelling("cli")
    pattern = re.compile(r"(--elastic-moe-[a-z-]+) " + _VALUE)

    def __init__(self, case, tmp_path):
        super().__init__(case, tmp_path)
        self.flags: dict[str, str] = {"--elastic-moe-" + name.replace("_", "-"): value for name, value in case.text.items()}

    def argv(self) -> list[str]:
        return [word for flag, value in self.flags.items() for word in (flag, value)]

    def run(self):
        parser = argparse.ArgumentParser(exit_on_error=False)
        add_cli_arguments(parser)
        config_from_cli(parser.parse_args(self.argv()), environ={}, model=self.case.model)

    def apply(self, text):
        flag, value = shlex.split(text)
        self.flags[flag] = value

    def rename(self, old, new):
        self.flags[new] = self.flags.pop(old)

    def setting_name(self, written):
        return written.removeprefix("--elastic-moe-").replace("-", "_")


class MegatronLmEntry(CliEntry):
    def run(self):
        from elastic_moe_plugin.mcore.megatron_args import check_megatron_args
        from elastic_moe_plugin.megatron_lm import parse_argv

        model = self.case.model
        megatron = ["--num-layers", str(model.num_layers), "--num-experts", str(model.num_experts),
                    "--moe-router-topk", str(model.topk), "--lr", "1e-3"]
        launch = parse_argv(["pretrain_gpt.py", *megatron, *self.argv()], environ={})
        check_megatron_args(launch.config, launch.megatron_args)


class ScheduleCliEntry(Entry):
    spelling = Spelling("schedule_cli")
    pattern = re.compile(r"(elastic-moe schedule|--sigma) " + _VALUE + r"|(--allow-off-center)")

    def __init__(self, case, tmp_path):
        super().__init__(case, tmp_path)
        self.spec = case.text.get("schedule")
        self.sigma = case.text.get("sigma")
        self.allow = case.text.get("allow_off_center") == "1"

    def run(self):
        from elastic_moe_plugin.cli import build_parser
        from elastic_moe_plugin.cli.schedule import run

        argv = ["schedule", *([self.spec] if self.spec is not None else []), "--center", str(self.case.model.topk),
                "--experts", str(self.case.model.num_experts), *(["--sigma", self.sigma] if self.sigma else []),
                *(["--allow-off-center"] if self.allow else []), "--json"]
        run(build_parser(argv).parse_args(argv))

    def apply(self, text):
        if text == "--allow-off-center":
            self.allow = True
        elif text.startswith("elastic-moe schedule "):
            self.spec = shlex.split(text)[2]
        else:
            flag, value = shlex.split(text)
            assert flag == "--sigma", text
            self.sigma = value

    def setting_name(self, written):
        return {"elastic-moe schedule": "schedule", "--sigma": "sigma", "--allow-off-center": "allow_off_center"}[written]


ENTRY_CLASSES = {"python": PythonEntry, "env": EnvEntry, "yaml": YamlEntry, "cli": CliEntry,
                 "megatron_lm": MegatronLmEntry, "schedule_cli": ScheduleCliEntry}


def _yaml_text(text: str) -> str:
    """``text`` as a user types it in YAML: bare (``sigma: 0`` is a number, ``layers: 16`` too), quoted only
    where it would be no scalar at all."""
    return "''" if text == "" else text


def _schedule_cli_can_express(case: Case) -> bool:
    return set(case.text) <= {"schedule", "sigma", "allow_off_center"} and case.text.get("allow_off_center", "1") == "1"


INSTANCES = [(name, entry) for name, case in CASES.items() for entry in case.entries
             if entry != "schedule_cli" or _schedule_cli_can_express(case)]


# ==================================================================================== the checks
def _settings_in(message: str, entry: Entry) -> list[tuple[str, str]]:
    """(field, value text) of every setting-shaped text in ``message``, found by the entry's pattern."""
    found = []
    for match in entry.pattern.finditer(message):
        groups = [group for group in match.groups() if group is not None]
        if len(groups) == 1:  # a flag with no value (--allow-off-center)
            found.append((entry.setting_name(groups[0]), "1"))
            continue
        written, value = groups
        found.append((entry.setting_name(written), value.rstrip(".,")))  # no value ends in a full stop or comma
    return found


def _parsed(entry: Entry, name: str, text: str) -> Any:
    """The value ``text`` means in this entry point, or the text itself where it means none."""
    try:
        return entry.parse_value(name, text)
    except Exception:  # noqa: BLE001 - an unreadable value stands for itself
        return text



def _same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


@pytest.mark.parametrize(("case_name", "entry_name"), INSTANCES, ids=[f"{entry}: {name}" for name, entry in INSTANCES])
def test_every_fix_is_accepted_through_the_same_entry_point(case_name, entry_name, tmp_path):
    case = CASES[case_name]
    entry = ENTRY_CLASSES[entry_name](case, tmp_path)
    with pytest.raises(ConfigError) as caught:
        entry.run()
    error = caught.value
    message = str(error)
    assert case.says in message, message
    assert error.fixes, f"no fix offered: {message}"
    spelled_fixes = []
    for fix in error.fixes:
        texts = [entry.spelling.setting(name, value) for name, value in fix.items()]
        for text in texts:
            assert text in message, (text, message)
        spelled_fixes.append(texts)
    # every setting the message spells is the refused input as typed, or a declared fix
    typed = case.python_values() if entry_name == "python" else case.text
    allowed_values = {name: [value, _parsed(entry, name, value) if isinstance(value, str) and entry_name != "python"
                             else value] for name, value in typed.items() if name in FIELDS}
    for fix in error.fixes:
        for name, value in fix.items():
            allowed_values.setdefault(name, []).append(value)
    for name, value_text in _settings_in(message, entry):
        if name not in FIELDS:
            continue  # an unknown name as typed
        value = True if entry_name == "schedule_cli" and name == "allow_off_center" else _parsed(entry, name, value_text)
        assert any(_same(value, allowed) or value_text == str(allowed) for allowed in allowed_values.get(name, [])), \
            f"{name}={value_text!r} is spelled in the message but is neither the input nor a declared fix: {message}"
    # each fix, as the message spells it, applied through the same entry point, is accepted
    for fix, texts in zip(error.fixes, spelled_fixes):
        fixed = ENTRY_CLASSES[entry_name](case, tmp_path)
        for old, new in error.renames.items():  # an unknown name: renamed as the message says, then the value set
            fixed.rename(old, new)
        for text in texts:
            fixed.apply(text)
        try:
            fixed.run()
        except ConfigError as refused:
            pytest.fail(f"the fix {' and '.join(texts)} of\n  {message}\nwas refused:\n  {refused}")


def test_the_case_list_covers_what_the_issue_names():
    """Centre mismatches, low = 0, reversed and out-of-range layer ranges, σ = 0, unknown names and bad
    booleans, each through every entry point that can express it."""
    kinds = {"centre": "routes to top-", "low 0": "low=0", "reversed layers": "reversed range",
             "layers out of range": "selects layer(s)", "sigma 0": "sigma 0", "unknown name": "did you mean",
             "bad boolean": "enabled maybe"}
    for kind, marker in kinds.items():
        assert any(marker in case.says or marker == name for name, case in CASES.items()), kind
    by_entry = {entry: sum(1 for _, e in INSTANCES if e == entry) for entry in ENTRIES}
    assert len(CASES) >= 60 and all(count >= 25 for count in by_entry.values()), by_entry


def test_a_bare_python_config_suggests_fixes_valid_without_a_model():
    """``ElasticConfig(...)`` does not know the model: its fixes are checked against what can be checked
    without one (they construct), and resolve() then checks against the model with fixes of its own."""
    for kwargs in ({"schedule": "9-7"}, {"schedule": "0-16"}, {"layers": "7-3"}, {"sigma": 0}, {"layers": "none"},
                   {"schedule": "six"}, {"center": 5, "schedule": "6-10"}):
        with pytest.raises(ConfigError) as caught:
            ElasticConfig(**kwargs)
        assert caught.value.fixes, kwargs
        for fix in caught.value.fixes:
            ElasticConfig(**{**kwargs, **fix})


def test_a_fix_the_model_refuses_is_not_printed():
    """9-7 on a top-2 model: turning the range round gives 7-9, which top-2 refuses, so the message
    offers the range of the same width around top-2 instead (it used to print 7-9)."""
    with pytest.raises(ConfigError) as caught:
        ElasticConfig.from_env({"ELASTIC_MOE_SCHEDULE": "9-7"}, model=TOP2)
    assert caught.value.fixes == ({"schedule": "1-3"},)
    assert "ELASTIC_MOE_SCHEDULE=7-9" not in str(caught.value) and "ELASTIC_MOE_SCHEDULE=1-3" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        ElasticConfig.from_env({"ELASTIC_MOE_SCHEDULE": "9-7"}, model=TOP8)
    assert caught.value.fixes == ({"schedule": "7-9"},)  # there, the turned-round range fits


def test_values_are_echoed_as_typed():
    """``ELASTIC_MOE_SIGMA=0`` is echoed as ``0`` (not ``0.0``), flags as ``--flag value``."""
    with pytest.raises(ConfigError, match=r"^environment: ELASTIC_MOE_SIGMA=0 is invalid"):
        ElasticConfig.from_env({"ELASTIC_MOE_SIGMA": "0"})
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    with pytest.raises(ConfigError, match=r"^command line: --elastic-moe-enabled maybe is invalid"):
        config_from_cli(parser.parse_args(["--elastic-moe-enabled", "maybe"]), environ={})
    with pytest.raises(ConfigError, match=r"^environment: ELASTIC_MOE_LAYERS=7-3 has a reversed range '7-3'\. "
                                          r"Use ELASTIC_MOE_LAYERS=3-7"):
        ElasticConfig.from_env({"ELASTIC_MOE_LAYERS": "7-3"})


@pytest.mark.parametrize("entry", ["env", "yaml", "cli", "python"])
def test_layers_all_and_none_mean_the_same_everywhere(entry, tmp_path):
    """``all`` (and unset) is every MoE layer in every entry point; ``none`` is refused in every one."""
    every = Case({"layers": "all"}, TOP8, "")
    ENTRY_CLASSES[entry](every, tmp_path).run()
    refused = Case({"layers": "none"}, TOP8, "")
    with pytest.raises(ConfigError, match="ambiguous"):
        ENTRY_CLASSES[entry](refused, tmp_path).run()
