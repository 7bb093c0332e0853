"""Recipes (configs/), the launcher, the budget, the wrappers and the Megatron-LM entry point.

One check runs in a subprocess, started as soon as a test that needs it is collected so it
overlaps with the in-process tests: ``python -m elastic_moe_plugin.tools.recipes.argcheck``, every
recipe's rendered flags through ms-swift's and Megatron-LM's own argument parsers (plus negative
controls that must fail). The Megatron-LM entry point's training runs (Megatron-LM's own loop, under
torchrun on CPU) are in ``tests/mcore/test_megatron_lm.py``; its argument splitting is tested here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elastic_moe_plugin import cli
from elastic_moe_plugin.core.config import ENV_VARS, ElasticConfig
from elastic_moe_plugin.megatron_lm import parse_argv, split_argv
from elastic_moe_plugin.tools.recipes.load import list_recipe_files, load_recipe, load_tree, setting_dirs
from elastic_moe_plugin.tools.recipes.recipe import CONFIGS_DIR, display_path
from elastic_moe_plugin.tools.recipes.render import prepare_model_override, render
from elastic_moe_plugin.tools.recipes.schema import RecipeError
from elastic_moe_plugin.tools.recipes.topology import first_slurm_host, resolve_topology

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "recipes.md"
SETTINGS = ("olmoe_sft", "qwen3_sft", "pretrain", "pretrain_titan")
RECIPES = list_recipe_files()
RECIPE_IDS = [name for name, _ in RECIPES]
OWN_YAML = sorted(
    [p for d in setting_dirs() for p in d.glob("*.yaml")] + list((CONFIGS_DIR / "overlays").glob("*.yaml"))
)
CLEAN_ENV_PREFIXES = ("SLURM_", "PET_", "ELASTIC_MOE_", "TORCHELASTIC_")
CLEAN_ENV_NAMES = {"NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE", "LOCAL_RANK",
                   "GROUP_RANK", "RANK", "WORLD_SIZE", "MEGATRON_LM_DIR"}


def _clear_launcher_env(monkeypatch) -> None:
    """Unset the scheduler, torchrun and plugin variables a launch would read from this process."""
    for key in list(os.environ):
        if key.startswith(CLEAN_ENV_PREFIXES) or key in CLEAN_ENV_NAMES:
            monkeypatch.delenv(key)


def _flat(text: str) -> str:
    """A rendered command with its backslash-newline continuations joined into one line."""
    return re.sub(r"\s*\\\n\s*", " ", text)

HAVE_SWIFT = importlib.util.find_spec("swift") is not None
HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None

BAD_ARGCHECK = {
    # file name -> (extends, args, expected error fragment)
    "bad_swift_flag": ("olmoe_sft", {"no_such_flag": 1}, "does not accept: ['--no_such_flag', '1']"),
    "bad_swift_packing": ("olmoe_sft", {"attn_impl": "sdpa"}, "requires a flash attention implementation"),
    "bad_megatron_sft_choice": ("qwen3_sft", {"moe_token_dispatcher_type": "alltoal"}, "invalid choice: 'alltoal'"),
    "bad_megatron_extra_kwargs": ("qwen3_sft", {"megatron_extra_kwargs": {"moe_router_topkk": 9}},
                                  "['moe_router_topkk'] are not TransformerConfig fields"),
    "bad_mlm_flag": ("pretrain", {"moe-token-dispatcher": "alltoall"}, "unrecognized arguments: --moe-token-dispatcher"),
    "bad_mlm_validate": ("pretrain", {"save-interval": None}, "assert args.save_interval is not None"),
}


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(CLEAN_ENV_PREFIXES) and k not in CLEAN_ENV_NAMES}
    env.update(extra)
    return env


def _run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


# ====================================================================================== subprocesses
class _Background:
    """Heavy subprocess checks, started once and together."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self.results: dict[str, tuple[int, str, str]] = {}

    def start(self, names: set[str]) -> None:
        env = _clean_env(TORCH_COMPILE_DISABLE="1", PYTHONUNBUFFERED="1")
        if "argcheck" in names and "argcheck" not in self.procs:
            bad = []
            for name, (setting, args, _) in BAD_ARGCHECK.items():
                path = self.tmp / setting / f"{name}.yaml"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(yaml.safe_dump({"extends": [str(CONFIGS_DIR / setting / "base.yaml")], "args": args}))
                bad.append(str(path))
            self.procs["argcheck"] = subprocess.Popen(
                [sys.executable, "-m", "elastic_moe_plugin.tools.recipes.argcheck", "--json", *[str(p) for _, p in RECIPES], *bad],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
            )

    def result(self, name: str) -> tuple[int, str, str]:
        if name not in self.results:
            self.start({name})
            out, err = self.procs[name].communicate(timeout=600)
            self.results[name] = (self.procs[name].returncode, out, err or "")
        return self.results[name]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="module")
def background(tmp_path_factory, request):
    runner = _Background(tmp_path_factory.mktemp("recipes_bg"))
    wanted = set()
    for item in request.session.items:
        if item.module is not None and item.module.__name__ == __name__:
            if "argcheck" in item.fixturenames:
                wanted.add("argcheck")
    runner.start(wanted)
    yield runner
    runner.stop()


@pytest.fixture(autouse=True)
def _start_background_early(background):
    """Every test of this module pulls the fixture in, so the subprocesses start with the first test."""


@pytest.fixture(scope="module")
def argcheck(background):
    if not HAVE_SWIFT:
        pytest.skip("ms-swift is not installed")
    code, out, err = background.result("argcheck")
    assert out.strip(), f"recipe_argcheck printed nothing (exit {code}):\n{err[-4000:]}"
    return json.loads(out)


# ====================================================================================== recipes load and render
def test_every_setting_has_the_eleven_schedules():
    names = {name for name, _ in RECIPES}
    for setting in SETTINGS:
        for schedule in ("top8", "7-9", "6-10", "5-11", "6-10_sigma1.0", "6-10_sigma3.0", "6-10_L3-7", "6-10_L8-12",
                         "top9", "top10", "top-p0.4"):
            assert f"{setting}/{schedule}" in names


@pytest.mark.parametrize("path", OWN_YAML, ids=[f"{p.parent.name}/{p.name}" for p in OWN_YAML])
def test_every_yaml_file_loads(path):
    data, origin = load_tree(path)
    assert data
    if path.parent.name != "overlays":
        recipe = load_recipe(path)
        assert recipe.setting == path.parent.name
        assert origin[("launcher",)].endswith("base.yaml")


@pytest.mark.parametrize("path", [p for _, p in RECIPES], ids=RECIPE_IDS)
def test_recipe_renders_for_2x8_with_its_elastic_environment(path):
    recipe = load_recipe(path)
    command = render(recipe, resolve_topology(recipe, environ={}))
    elastic_env = {k: v for k, v in command.env.items() if k.startswith("ELASTIC_MOE_")}
    assert set(elastic_env) == set(ENV_VARS.values())
    assert ElasticConfig.from_env(elastic_env) == recipe.elastic
    text = command.shell()
    assert f"ELASTIC_MOE_SCHEDULE={recipe.elastic.schedule}" in text
    if recipe.launcher == "megatron_lm":
        assert command.argv[:5] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "8"]
        assert "-m elastic_moe_plugin.megatron_lm" in text
        assert f"--moe-router-topk {recipe.model.training_topk}" in text
    elif recipe.launcher == "torchtitan":
        from elastic_moe_plugin.core.config import config_from_override

        assert command.argv[:5] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "8"]
        assert command.argv[command.argv.index("-m") + 1] == "torchtitan.train"
        # the door's JSON is the recipe's elastic block, alone and over the rendered variables
        target, _, fields = command.argv[-1].partition("=")
        assert command.argv[-2] == "--override.imports" and target == "elastic_moe_plugin.titan.elastic_moe"
        assert config_from_override(json.loads(fields), environ={}) == recipe.elastic
        assert config_from_override(json.loads(fields), environ=elastic_env) == recipe.elastic
    else:
        assert command.argv[:2] == (["swift", "sft"] if recipe.launcher == "swift_sft" else ["megatron", "sft"])
        assert command.env["NNODES"] == "2" and command.env["NPROC_PER_NODE"] == "8"
        _assert_loads_the_plugin_and_logs_its_metrics(command.argv)


def _assert_loads_the_plugin_and_logs_its_metrics(argv: list[str]) -> None:
    """The rendered ms-swift command loads the plugin file and names the ``elastic_moe`` callback,
    either itself (path form) or through the start-up hook's rewrite of ``--plugin elastic_moe``."""
    from elastic_moe_plugin.swift import plugin_path
    from elastic_moe_plugin.swift.plugin_flag import rewrite

    if "--plugin" in argv:
        assert argv[argv.index("--plugin") + 1] == "elastic_moe" and "--external_plugins" not in argv
        argv = rewrite(argv[2:], "sft").argv
    assert argv[argv.index("--external_plugins") + 1] == str(plugin_path())
    assert argv[argv.index("--callbacks") + 1] == "elastic_moe"


@pytest.mark.parametrize("hook", [False, True], ids=["path form", "--plugin form"])
@pytest.mark.parametrize("name", ["olmoe_sft/6-10", "qwen3_sft/6-10", "olmoe_sft/top8"])
def test_rendered_swift_commands_log_the_routing_metrics(monkeypatch, name, hook):
    """Where this environment has the start-up hook (a wheel install), ``--plugin elastic_moe``;
    where not (an editable checkout), ``--external_plugins FILE --callbacks elastic_moe``. Either way
    the run logs the metrics (the paper recipes used to leave ``--callbacks`` out)."""
    from elastic_moe_plugin.tools.recipes import render as render_module

    monkeypatch.setattr(render_module, "hook_installed", lambda: hook)
    recipe = load_recipe(name)
    command = render(recipe, resolve_topology(recipe, environ={}))
    assert ("--plugin" in command.argv) is hook
    _assert_loads_the_plugin_and_logs_its_metrics(command.argv)
    assert any(note.startswith("the plugin: ") for note in command.notes)


def test_a_recipe_callbacks_flag_is_extended_not_replaced(monkeypatch):
    from elastic_moe_plugin.tools.recipes import render as render_module

    monkeypatch.setattr(render_module, "hook_installed", lambda: False)
    recipe = load_recipe("olmoe_sft/6-10", ["args.callbacks=[early_stop]"])
    argv = render(recipe, resolve_topology(recipe, environ={})).argv
    assert argv.count("--callbacks") == 1
    assert argv[argv.index("--callbacks") + 1: argv.index("--callbacks") + 3] == ["early_stop", "elastic_moe"]


def test_launch_list_prints_every_recipe_with_its_description(capsys):
    from elastic_moe_plugin.cli import main
    from elastic_moe_plugin.tools.recipes.load import list_recipes

    assert main(["launch", "--list"]) == 0
    out = capsys.readouterr().out
    rows = list_recipes()
    assert len(rows) == 44
    for row in rows:
        assert any(line.startswith(row["name"] + " ") and line.rstrip().endswith(row["description"])
                   for line in out.splitlines()), row


def test_top9_control_is_trained_at_9_and_evaluated_at_8():
    olmoe = load_recipe("configs/olmoe_sft/top9.yaml")
    command = render(olmoe, resolve_topology(olmoe, environ={}))
    assert command.prepare == [("allenai/OLMoE-1B-7B-0924", {"num_experts_per_tok": 9}, "output/olmoe_sft/top9/model-top9")]
    assert command.argv[command.argv.index("--model") + 1] == "output/olmoe_sft/top9/model-top9"
    qwen = load_recipe("configs/qwen3_sft/top10.yaml")
    argv = render(qwen, resolve_topology(qwen, environ={})).argv
    assert json.loads(argv[argv.index("--megatron_extra_kwargs") + 1]) == {"moe_router_topk": 10}
    for recipe in (olmoe, qwen, load_recipe("configs/pretrain/top9.yaml")):
        assert recipe.model.topk == 8 and recipe.elastic.budget_schedule(recipe.model.training_topk).is_static


def test_prepare_model_override_writes_config_and_links_weights(tmp_path):
    source = tmp_path / "ckpt"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"num_experts_per_tok": 8, "model_type": "olmoe"}))
    (source / "model.safetensors").write_text("weights")
    dest = prepare_model_override(str(source), {"num_experts_per_tok": 9}, tmp_path / "out" / "model-top9")
    assert json.loads((dest / "config.json").read_text()) == {"num_experts_per_tok": 9, "model_type": "olmoe"}
    assert (dest / "model.safetensors").is_symlink() and (dest / "model.safetensors").read_text() == "weights"
    assert prepare_model_override(str(source), {"num_experts_per_tok": 9}, dest) == dest  # idempotent


# ====================================================================================== framework argument parsers
SWIFT_RECIPES = [(n, p) for n, p in RECIPES if n.split("/")[0] in ("olmoe_sft", "qwen3_sft")]
MLM_RECIPES = [(n, p) for n, p in RECIPES if n.startswith("pretrain/")]


@pytest.mark.swift
@pytest.mark.parametrize("name", [n for n, _ in SWIFT_RECIPES])
def test_ms_swift_accepts_the_rendered_arguments(argcheck, name):
    entry = argcheck["recipes"][name]
    assert entry.get("ok"), entry.get("error") or entry.get("skipped")
    parser = "MegatronSftArguments" if name.startswith("qwen3_sft/") else "SftArguments"
    assert f"{parser} parser (ms-swift)" in entry["checked"]
    # the --plugin form (after the start-up hook's rewrite) and the path form both parse, load the
    # plugin file and name the elastic_moe callback
    assert "--plugin elastic_moe rewritten as the start-up hook does" in entry["checked"]
    assert "external_plugins loads the plugin file; callbacks include 'elastic_moe'" in entry["checked"]


@pytest.mark.parametrize("name", [n for n, _ in MLM_RECIPES])
def test_megatron_lm_accepts_the_rendered_arguments(argcheck, name):
    entry = argcheck["recipes"][name]
    if "skipped" in entry:
        pytest.skip(entry["skipped"])
    assert entry.get("ok"), entry.get("error")
    assert "validate_args with world_size=16" in entry["checked"]
    assert "padded vocab 151669 -> 151936" in entry["checked"]


@pytest.mark.parametrize("name", sorted(BAD_ARGCHECK))
def test_framework_parsers_reject_bad_arguments(argcheck, name):
    setting, _, fragment = BAD_ARGCHECK[name]
    entry = argcheck["recipes"][f"{setting}/{name}"]
    if "skipped" in entry:
        pytest.skip(entry["skipped"])
    assert not entry["ok"]
    assert fragment in entry["error"]


# ====================================================================================== the paper table
def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _tables() -> list[tuple[str, str, list[str], list[list[str]]]]:
    """[(heading, file named in the heading, header cells, rows)] of docs/recipes.md's tables."""
    tables, heading, lines = [], None, DOCS.read_text().splitlines()
    for index, line in enumerate(lines):
        if line.startswith("### "):
            heading = line[4:].strip()
        if heading and line.startswith("|") and index + 1 < len(lines) and re.match(r"^\|[-| ]+\|$", lines[index + 1]):
            rows = []
            for row in lines[index + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(_cells(row))
            match = re.search(r"`([^`]+\.yaml)`", heading)
            tables.append((heading, match.group(1) if match else "", _cells(line), rows))
    return tables


def _value(cell: str):
    text = cell.strip()
    if text.startswith("`") and text.endswith("`"):
        text = text[1:-1]
    return yaml.safe_load(text)


def _number(value):
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(str(value).replace(",", ""))
    except ValueError:
        return None


def _same(a, b) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    x, y = _number(a), _number(b)
    if x is not None and y is not None:
        return math.isclose(x, y, rel_tol=1e-12)
    return a == b


def _get(data: dict, dotted: str):
    node = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


def _leaves(data: dict, path=()):
    for key, value in data.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, path + (key,))
        else:
            yield ".".join(path + (key,))


KEY_TABLES = [t for t in _tables() if t[2][:5] == ["Item", "Key", "Paper", "Recipe", "Source"]]
KEY_ROWS = [(file, row) for _, file, _, rows in KEY_TABLES for row in rows]
SOURCES = {"paper", "derived", "external", "unspecified", "operational"}


def test_docs_have_a_key_table_per_setting():
    files = {file for _, file, _, _ in KEY_TABLES}
    for setting in SETTINGS:
        assert f"configs/{setting}/base.yaml" in files
    assert len(KEY_ROWS) > 150


@pytest.mark.parametrize("file,row", KEY_ROWS, ids=[f"{Path(f).parent.name}/{Path(f).stem}:{r[1].strip('`')}" for f, r in KEY_ROWS])
def test_paper_table_row_matches_the_yaml(file, row):
    item, key, paper, recipe_cell, source = row
    key = key.strip("`")
    assert source in SOURCES, f"{key}: source {source!r} is not one of {sorted(SOURCES)}"
    data, _ = load_tree(REPO / file)
    actual = _get(data, key)
    expected = _value(recipe_cell)
    assert _same(actual, expected), f"{file}: {key} is {actual!r} in the YAML but {expected!r} in docs/recipes.md"
    if source == "paper":
        number = _number(paper)
        if number is not None:
            assert _same(number, actual), f"{key}: the paper says {paper}, the recipe has {actual!r}"
    if source == "unspecified":
        assert paper.startswith("unspecified"), f"{key}: an unspecified row must say so in the Paper column"


@pytest.mark.parametrize("file", sorted({f for f, _ in KEY_ROWS if f.endswith("base.yaml")}))
def test_paper_table_covers_every_key_of_the_base(file):
    data, _ = load_tree(REPO / file)
    documented = {row[1].strip("`") for f, row in KEY_ROWS if f == file}
    missing = sorted(set(_leaves(data)) - documented)
    extra = sorted(documented - set(_leaves(data)))
    assert not missing, f"{file}: keys without a row in docs/recipes.md: {missing}"
    assert not extra, f"docs/recipes.md has rows for keys {file} does not set: {extra}"


_KEY_LINE = re.compile(r"^(\s*)[\"']?([A-Za-z0-9_.\-]+)[\"']?:(.*)$")  # a quoted key too ("0": a list index)


def _unspecified_keys(path: Path) -> set[str]:
    """Dotted keys whose YAML line carries ``# unspecified in the paper:`` (block-style YAML)."""
    found, stack = set(), []
    for line in path.read_text().splitlines():
        match = _KEY_LINE.match(line)
        if not match:
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match.group(2)))
        if "# unspecified in the paper:" in match.group(3):
            found.add(".".join(key for _, key in stack))
    return found


def test_unspecified_rows_and_yaml_comments_agree():
    in_yaml = {(str(p.resolve()), key) for p in OWN_YAML for key in _unspecified_keys(p)}
    in_docs = set()
    for file, row in KEY_ROWS:
        if row[4] == "unspecified":
            _, origin = load_tree(REPO / file)
            key = row[1].strip("`")
            in_docs.add((origin[tuple(key.split("."))], key))
    rel = lambda items: sorted(f"{os.path.relpath(f, REPO)}:{k}" for f, k in items)  # noqa: E731
    assert not in_yaml - in_docs, f"marked unspecified in the YAML but not in docs/recipes.md: {rel(in_yaml - in_docs)}"
    assert not in_docs - in_yaml, f"unspecified in docs/recipes.md but the YAML line has no comment: {rel(in_docs - in_yaml)}"
    assert len(in_yaml) > 40


SCHEDULE_TABLE = next(t for t in _tables() if t[2][0] == "Recipe")
SCHEDULE_KEYS = [re.search(r"`([^`]+)`", cell).group(1) for cell in SCHEDULE_TABLE[2][2:]]
SCHEDULE_CASES = [(setting, row) for setting in SETTINGS for row in SCHEDULE_TABLE[3]]


@pytest.mark.parametrize("setting,row", SCHEDULE_CASES, ids=[f"{s}/{r[0].strip('`')}" for s, r in SCHEDULE_CASES])
def test_schedule_table_row_matches_the_recipe(setting, row):
    recipe = load_recipe(CONFIGS_DIR / setting / f"{row[0].strip('`')}.yaml")
    for key, cell in zip(SCHEDULE_KEYS, row[2:]):
        try:
            actual = recipe.get(key)
        except KeyError:
            actual = None
        assert _same(actual, _value(cell)), f"{setting}/{row[0]}: {key} is {actual!r}, docs say {cell}"


def test_schedule_table_lists_every_recipe():
    documented = {row[0].strip("`") for row in SCHEDULE_TABLE[3]}
    for name, _ in RECIPES:
        assert name.split("/")[1] in documented, f"{name} has no row in the schedule table of docs/recipes.md"


# ====================================================================================== budget
def test_budget_of_the_pretraining_recipe():
    code, out, err = _run_cli("budget", "configs/pretrain/6-10.yaml", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["params"]["total"] == pytest.approx(1.427e9, rel=0.01)
    assert report["params"]["active"] == pytest.approx(0.365e9, rel=0.01)
    assert report["params"]["total"] == 1_426_784_256 and report["params"]["active"] == 365_101_056
    assert report["tokens"]["D"] == 25_034 * 256 * 4096
    assert report["compute"]["C"] == pytest.approx(6.0e19, rel=0.02)
    rows = {row["recipe"]: row for row in report["schedules"]}
    elastic = ["7-9", "6-10", "5-11", "6-10_sigma1.0", "6-10_sigma3.0", "6-10_L3-7", "6-10_L8-12"]
    for name in elastic:
        assert f"{rows[name]['expected_per_layer']:.3f}" == "8.000"
        assert f"{rows[name]['expected_mean']:.3f}" == "8.000"
    assert (rows["7-9"]["worst_per_layer"], rows["6-10"]["worst_per_layer"], rows["5-11"]["worst_per_layer"]) == (9, 10, 11)
    assert rows["6-10_L3-7"]["worst_mean"] == pytest.approx((5 * 10 + 15 * 8) / 20)
    assert rows["top9"]["expected_mean"] == 9 and rows["top10"]["expected_mean"] == 10 and rows["top8"]["expected_mean"] == 8
    assert rows["top-p0.4"]["expected_per_layer"] is None

    code, text, _ = _run_cli("budget", "configs/pretrain/6-10.yaml")
    assert code == 0
    assert "total 1.4268B" in text and "active 0.3651B" in text and "C = M * D = 6.0383e+19" in text
    for name in elastic:
        line = next(line for line in text.splitlines() if line[2:].startswith(name + " "))
        assert re.search(r"\s8\.000\s+8\.000\s", line), line
    assert "unknown" in next(line for line in text.splitlines() if "top-p0.4" in line)
    # The header's names hold no space, so it splits into exactly its columns, one per row field.
    header = next(line for line in text.splitlines() if line.strip().startswith("recipe "))
    assert header.split() == ["recipe", "routing", "layers", "E[kappa]/layer", "E[kappa]/model", "worst/layer",
                              "worst/model", "min/layer", "eval"]
    six_ten = next(line for line in text.splitlines() if line[2:].startswith("6-10 "))
    assert six_ten.split()[-5:] == ["8.000", "10", "10.000", "6", "top-8"]


@pytest.mark.parametrize("setting,total,active", [("olmoe_sft", 6.92e9, 1.28e9), ("qwen3_sft", 30.5e9, 3.35e9)])
def test_budget_of_the_sft_checkpoints(setting, total, active):
    code, out, _ = _run_cli("budget", f"configs/{setting}/6-10.yaml", "--json")
    report = json.loads(out)
    assert report["params"]["total"] == pytest.approx(total, rel=0.01)
    assert report["params"]["active"] == pytest.approx(active, rel=0.01)
    assert report["tokens"]["D"] is None and report["compute"]["C"] is None


# ====================================================================================== wrappers
WRAPPERS = {
    # script, schedule, extra args -> fragments that must appear in the dry run
    "olmoe_sft": ("6-10_L3-7", [], ["NNODES=2", "NPROC_PER_NODE=8", "ELASTIC_MOE_SCHEDULE=6-10",
                                     "ELASTIC_MOE_LAYERS=3-7", "swift sft", "--gradient_accumulation_steps 16",
                                     "python -m torch.distributed.run --nproc_per_node 8", "--nnodes 2"]),
    "qwen3_sft": ("top-p0.4", [], ["NNODES=2", "NPROC_PER_NODE=8", "ELASTIC_MOE_MODE=top_p", "ELASTIC_MOE_TOP_P=0.4",
                                   "megatron sft", "--pipeline_model_parallel_size 2",
                                   "--expert_model_parallel_size 8", "python -m torch.distributed.run --nproc_per_node 8",
                                   "--nnodes 2"]),
    "pretrain": ("6-10", ["--node-rank", "1", "--master-addr", "node0", "--", "--exit-interval", "10"],
                 ["torchrun", "--nnodes 2", "--nproc-per-node 8", "--node-rank 1", "--master-addr node0",
                  "ELASTIC_MOE_SCHEDULE=6-10", "ELASTIC_MOE_SIGMA=1.5", "-m elastic_moe_plugin.megatron_lm",
                  "--expert-model-parallel-size 4", "--exit-interval 10"]),
    "pretrain_titan": ("6-10_L8-12", ["--node-rank", "1", "--master-addr", "node0", "--", "--training.gc_freq", "100"],
                       ["torchrun", "--nnodes 2", "--nproc-per-node 8", "--node-rank 1", "--master-addr node0",
                        "ELASTIC_MOE_LAYERS=8-12", "-m torchtitan.train", "--parallelism.expert_parallel_degree 4",
                        "--parallelism.data_parallel_shard_degree 16",
                        """--override.imports 'elastic_moe_plugin.titan.elastic_moe={"schedule": "6-10", "sigma": 1.5, """
                        """"layers": "8-12", "gate": "auto", "sampling": "iid", "mode": "elastic"}'""",
                        "--training.gc_freq 100"]),
}


def test_wrapper_dry_runs_print_a_2x8_launch():
    procs = {}
    for setting, (schedule, extra, _) in WRAPPERS.items():
        procs[setting] = subprocess.Popen(
            ["bash", str(REPO / "scripts" / f"{setting}.sh"), schedule, *extra], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=_clean_env(DRY_RUN="1", PYTHON=sys.executable), cwd=REPO,
        )
    for setting, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        flat = _flat(out)
        for fragment in WRAPPERS[setting][2]:
            assert fragment in flat, f"scripts/{setting}.sh: {fragment!r} missing from:\n{out}"
        assert re.search(r"--nnodes[ =]2\b", flat) and re.search(r"--nproc[-_]per[-_]node[ =]8\b", flat)


def test_wrapper_lists_schedules_on_a_bad_name():
    result = subprocess.run(["bash", str(REPO / "scripts" / "pretrain.sh"), "6-11"], capture_output=True, text=True,
                            env=_clean_env(DRY_RUN="1", PYTHON=sys.executable))
    assert result.returncode == 2
    assert "no recipe configs/pretrain/6-11.yaml" in result.stderr and "6-10_L3-7" in result.stderr


def test_slurm_example_runs_a_wrapper_once_per_node():
    text = (REPO / "scripts" / "slurm_example.sbatch").read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=1" in text and "--gpus-per-node=8" in text
    assert re.search(r"srun .*scripts/\$\{SETTING\}\.sh", text)


# ====================================================================================== launch CLI and topology
def test_launch_dry_run_through_the_cli(monkeypatch):
    _clear_launcher_env(monkeypatch)
    code, out, err = _run_cli("launch", "pretrain/6-10_L8-12", "--dry-run", "--nnodes", "4",
                              "--set", "args.train-iters=10", "--", "--exit-interval", "5")
    assert code == 0, err
    flat = _flat(out)
    assert "torchrun --nnodes 4 --nproc-per-node 8" in flat
    assert "global batch 256 = micro 4 x DP 32 x accumulation 2" in out
    assert "ELASTIC_MOE_LAYERS=8-12" in flat and "--train-iters 10" in flat and flat.rstrip().endswith("--exit-interval 5")
    code, _, err = _run_cli("launch", "pretrain/6-10", "--dry-run", "--exit-interval", "5")
    assert code == 2 and "framework flags go after '--'" in err


def test_topology_from_slurm_and_environment():
    recipe = load_recipe("configs/qwen3_sft/6-10.yaml")
    slurm = {"SLURM_JOB_ID": "42", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
             "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_GPUS_ON_NODE": "8", "MASTER_PORT": "31000"}
    topology = resolve_topology(recipe, environ=slurm)
    assert (topology.nnodes, topology.node_rank, topology.master_addr, topology.master_port) == (2, 1, "gpu07", 31000)
    assert topology.sources["node_rank"] == "SLURM" and topology.sources["master_port"] == "environment"
    assert resolve_topology(recipe, node_rank=0, environ=slurm).node_rank == 0  # the flag wins
    env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "PET_NPROC_PER_NODE": "8"}
    topology = resolve_topology(recipe, environ=env)
    assert (topology.node_rank, topology.master_addr, topology.nproc_per_node) == (1, "10.0.0.1", 8)
    command = render(recipe, topology)
    assert (command.env["NODE_RANK"], command.env["MASTER_ADDR"]) == ("1", "10.0.0.1")
    with pytest.raises(RecipeError, match="inside a torchrun worker"):
        resolve_topology(recipe, environ={"TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "0"})
    with pytest.raises(RecipeError, match="node_rank=2 .* outside 0..1"):
        resolve_topology(recipe, node_rank=2, environ={})


@pytest.mark.parametrize("nodelist,first", [("gpu[07-08,11],cpu1", "gpu07"), ("node-3,node-4", "node-3"),
                                            ("a[001-004]", "a001"), ("single", "single"), ("r[5,7]x", "r5x")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


# ====================================================================================== bad recipes fail clearly
def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _base(setting: str) -> str:
    return str(CONFIGS_DIR / setting / "base.yaml")


def test_unknown_top_level_key_names_key_and_file(tmp_path):
    path = _write(tmp_path, "r.yaml", f"extends: {_base('pretrain')}\nelastik: {{schedule: 6-10}}\n")
    with pytest.raises(RecipeError) as error:
        load_recipe(path)
    assert str(path.resolve()) in str(error.value) and "'elastik'" in str(error.value) and "did you mean 'elastic'" in str(error.value)


def test_unknown_nested_key_names_the_file_that_wrote_it(tmp_path):
    overlay = _write(tmp_path, "overlay.yaml", "batch:\n  globl: 512\n")
    path = _write(tmp_path, "r.yaml", f"extends: [{_base('olmoe_sft')}, overlay.yaml]\n")
    with pytest.raises(RecipeError) as error:
        load_recipe(path)
    assert str(overlay.resolve()) in str(error.value) and "'batch.globl'" in str(error.value)
    assert "did you mean 'global'" in str(error.value)
    path = _write(tmp_path, "r2.yaml", f"extends: {_base('olmoe_sft')}\nelastic:\n  sigmaa: 2.0\n")
    with pytest.raises(RecipeError, match=r"r2\.yaml: unknown key 'elastic\.sigmaa' \(did you mean 'sigma'\?\)"):
        load_recipe(path)


@pytest.mark.parametrize("schedule", ["6-11", "5-9"])
def test_off_center_schedule_is_refused(tmp_path, schedule):
    path = _write(tmp_path, "r.yaml", f"extends: {_base('qwen3_sft')}\nelastic:\n  schedule: {schedule}\n")
    with pytest.raises(RecipeError) as error:
        load_recipe(path)
    message = str(error.value)
    assert message.startswith(display_path(path)) and "elastic.schedule" in message and schedule in message


def test_layer_range_outside_the_model_is_refused(tmp_path):
    path = _write(tmp_path, "r.yaml", f"extends: [{_base('olmoe_sft')}, {CONFIGS_DIR / 'overlays' / '6-10.yaml'}]\n"
                                      f"elastic:\n  layers: 12-17\n")
    with pytest.raises(RecipeError) as error:
        load_recipe(path)
    message = str(error.value)
    assert message.startswith(display_path(path)) and "elastic.layers" in message
    assert "[16, 17]" in message and "16 decoder layers" in message


@pytest.mark.parametrize("top_p", ["1.5", "0", "-0.1"])
def test_top_p_outside_unit_interval_is_refused(tmp_path, top_p):
    path = _write(tmp_path, "r.yaml", f"extends: [{_base('olmoe_sft')}, {CONFIGS_DIR / 'overlays' / 'top-p0.4.yaml'}]\n"
                                      f"elastic:\n  top_p: {top_p}\n")
    with pytest.raises(RecipeError) as error:
        load_recipe(path)
    assert str(error.value).startswith(display_path(path)) and "elastic.top_p" in str(error.value)
    assert "(0, 1]" in str(error.value)


def test_world_size_that_does_not_divide_is_refused_with_the_arithmetic(monkeypatch):
    _clear_launcher_env(monkeypatch)
    code, out, err = _run_cli("launch", "configs/pretrain/6-10.yaml", "--dry-run", "--nnodes", "1", "--nproc-per-node", "6")
    assert code == 2 and not out
    assert "configs/pretrain/6-10.yaml does not fit world size 6" in err
    assert "EP x ETP = 4 x 1 = 4 does not divide DP x CP x TP = 6 x 1 x 1 = 6" in err
    assert "global batch 256 is not divisible by micro batch x DP = 4 x 6 = 24" in err
    assert "World sizes this recipe accepts: 4, 8, 16, 32, 64" in err
    code, _, err = _run_cli("launch", "configs/qwen3_sft/6-10.yaml", "--dry-run", "--nnodes", "3", "--nproc-per-node", "8")
    assert code == 2 and "EP x ETP = 8 x 1 = 8 does not divide DP x CP x TP = 12 x 1 x 1 = 12" in err
    assert "global batch 16 is not divisible by micro batch x DP = 1 x 12 = 12" in err
    code, _, err = _run_cli("launch", "configs/olmoe_sft/6-10.yaml", "--dry-run", "--nnodes", "3", "--nproc-per-node", "8")
    assert code == 2 and "global batch 256 is not divisible by micro batch x DP = 1 x 24 = 24" in err


def test_other_recipe_mistakes_are_named(tmp_path):
    cases = {
        "args:\n  global_batch_size: 32\n": ("qwen3_sft", "args.global_batch_size is rendered from batch.global"),
        "env:\n  ELASTIC_MOE_SCHEDULE: 6-10\n": ("qwen3_sft", "put elastic settings in the 'elastic:' block"),
        "parallel:\n  ep: 2\n": ("olmoe_sft", "pure data parallel"),
        "args:\n  output_dir: out/${run}\n": ("olmoe_sft", "args.output_dir uses ${run}"),
        "model:\n  train_topk: 65\n": ("olmoe_sft", "training top-k 65 exceeds model.num_experts=64"),
    }
    for index, (body, (setting, fragment)) in enumerate(cases.items()):
        path = _write(tmp_path, f"r{index}.yaml", f"extends: {_base(setting)}\n{body}")
        with pytest.raises(RecipeError) as error:
            load_recipe(path)
        assert fragment in str(error.value), str(error.value)
    overlay = _write(tmp_path, "only_overlay.yaml", "elastic:\n  schedule: 6-10\n")
    with pytest.raises(RecipeError, match="this file is an overlay"):
        load_recipe(overlay)
    a = _write(tmp_path, "a.yaml", "extends: b.yaml\n")
    _write(tmp_path, "b.yaml", "extends: a.yaml\n")
    with pytest.raises(RecipeError, match="forms a cycle"):
        load_recipe(a)
    with pytest.raises(RecipeError, match="extends 'missing.yaml'"):
        load_recipe(_write(tmp_path, "c.yaml", "extends: missing.yaml\n"))
    with pytest.raises(RecipeError, match="unknown key 'batch.globl'"):
        load_recipe("configs/pretrain/6-10.yaml", ["batch.globl=3"])
    assert load_recipe("configs/pretrain/6-10.yaml", ["elastic.schedule=7-9"]).elastic.schedule == "7-9"


# ====================================================================================== the Megatron-LM entry point
def test_entry_point_takes_the_elastic_flags_out():
    config, script, rest = split_argv(
        ["train.py", "--num-layers", "2", "--elastic-moe-schedule", "5-11", "--lr", "-1e-3",
         "--elastic-moe-layers=3-7", "--data-path", "a", "b"], environ={})
    assert (config.schedule, config.layers, script) == ("5-11", "3-7", "train.py")
    assert rest == ["--num-layers", "2", "--lr", "-1e-3", "--data-path", "a", "b"]
    with pytest.raises(ValueError, match="did you mean --elastic-moe-schedule"):
        split_argv(["train.py", "--elastic-moe-shedule", "6-10"], environ={})
    with pytest.raises(ValueError, match="no training script"):
        split_argv(["--elastic-moe-schedule", "6-10"], environ={})
    with pytest.raises(ValueError, match="--elastic-moe-top-p 2 is invalid"):
        split_argv(["train.py", "--elastic-moe-top-p", "2"], environ={})


def test_entry_point_logs_routing_metrics_unless_told_not_to():
    # ElasticConfig.log_metrics; the entry point's old true/false read as layers/off
    assert parse_argv(["train.py", "--lr", "1"], environ={}).config.log_metrics == "layers"
    launch = parse_argv(["train.py", "--elastic-moe-log-metrics", "false", "--lr", "1"], environ={})
    assert launch.config.log_metrics == "off" and launch.megatron_args == ["--lr", "1"]
    assert parse_argv(["train.py", "--elastic-moe-log-metrics=off"], environ={}).config.log_metrics == "off"
    assert parse_argv(["train.py", "--elastic-moe-log-metrics", "true"], environ={}).config.log_metrics == "layers"
    assert parse_argv(["train.py", "--elastic-moe-log-metrics", "means"], environ={}).config.log_metrics == "means"
    with pytest.raises(ValueError, match=r"--elastic-moe-log-metrics maybe is not a metrics layout: expected "
                                         r"--elastic-moe-log-metrics layers"):
        parse_argv(["train.py", "--elastic-moe-log-metrics", "maybe"], environ={})
    with pytest.raises(ValueError, match="did you mean --elastic-moe-log-metrics"):
        parse_argv(["train.py", "--elastic-moe-log-metric", "false"], environ={})


# ================================================================================== the rehearsal (planning only)
# The rehearsals themselves (the launchers running) are in tests/swift/test_rehearse.py.
def _flag_values(argv: list[str]) -> dict[str, list[str]]:
    """``--flag value...`` words -> {flag: [values]} (a switch maps to [])."""
    flags: dict[str, list[str]] = {}
    current = None
    for word in argv:
        if word.startswith("--"):
            current = word[2:]
            flags[current] = []
        elif current is not None:
            flags[current].append(word)
    return flags


#: flags the structured blocks render, replaced as "model", "cluster/parallel" or "batch.seq_length"
_STRUCTURED = {"model", "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
               "expert_model_parallel_size", "expert_tensor_parallel_size", "gradient_accumulation_steps",
               "max_length", "num-layers", "hidden-size", "num-attention-heads", "num-query-groups", "kv-channels",
               "num-experts", "moe-ffn-hidden-size", "make-vocab-size-divisible-by", "seq-length",
               "max-position-embeddings", "expert-model-parallel-size", "external_plugins", "nproc-per-node",
               "master-port", "nnodes", "node-rank", "master-addr",
               # torchtitan: batch.seq_length, cluster/parallel, and the door's JSON (elastic.layers scaled)
               "training.seq_len", "parallelism.data_parallel_shard_degree", "parallelism.expert_parallel_degree",
               "override.imports"}


@pytest.mark.parametrize("name", RECIPE_IDS)
def test_a_rehearsal_changes_only_what_it_lists(name, tmp_path, monkeypatch):
    """Every flag of the rehearsal's command is the recipe's own (rendered for 2 x 8), unless the
    rehearsal lists it as replaced (``args.<flag>``) or it is rendered from a replaced block; the
    elastic environment is the recipe's, with the layer range scaled to the tiny depth."""
    from elastic_moe_plugin.tools.recipes.rehearse import TINY_LAYERS, plan_rehearsal
    from elastic_moe_plugin.tools.recipes.render import framework_args

    _clear_launcher_env(monkeypatch)
    recipe = load_recipe(name)
    topology = resolve_topology(recipe, environ={})
    original = _flag_values(framework_args(render(recipe, topology, megatron_lm_dir="/nonexistent")))
    plan = plan_rehearsal(name, work_dir=tmp_path / "work", build_assets=False)
    rehearsed = _flag_values(framework_args(plan.command))
    listed = {item.key.removeprefix("args.") for item in plan.replacements}
    changed = {flag for flag in original.keys() | rehearsed.keys() if original.get(flag) != rehearsed.get(flag)}
    unexplained = changed - listed - _STRUCTURED
    assert not unexplained, {flag: (original.get(flag), rehearsed.get(flag)) for flag in unexplained}
    assert all(item.reason for item in plan.replacements)
    # the overlay: schedule, sigma, gate, sampling and mode as the recipe has them
    elastic, tiny = recipe.elastic, plan.recipe.elastic
    assert (tiny.schedule, tiny.sigma, tiny.gate, tiny.sampling, tiny.mode) == (
        elastic.schedule, elastic.sigma, elastic.gate, elastic.sampling, elastic.mode)
    if elastic.layers is not None:
        from elastic_moe_plugin.core.config import parse_layers

        layers = parse_layers(tiny.layers)
        assert layers and max(layers) < TINY_LAYERS
        assert layers == {i * TINY_LAYERS // recipe.model.num_layers for i in parse_layers(elastic.layers)}
    assert (plan.recipe.model.topk, plan.recipe.model.train_topk) == (recipe.model.topk, recipe.model.train_topk)
    assert plan.command.env["CUDA_VISIBLE_DEVICES"] == "" and plan.command.env["HF_HUB_OFFLINE"] == "1"


def test_rehearsal_of_the_megatron_sft_recipe_runs_every_process_under_the_cpu_bootstrap(tmp_path):
    from elastic_moe_plugin.tools import child_bootstrap
    from elastic_moe_plugin.tools.recipes.rehearse import plan_rehearsal

    plan = plan_rehearsal("qwen3_sft/6-10", work_dir=tmp_path / "work", build_assets=False)
    assert plan.command.env["PYTHONPATH"].split(os.pathsep)[0] == str(child_bootstrap.directory())
    assert plan.command.env[child_bootstrap.BOOTSTRAP_ENV] == "megatron_swift"
    assert (child_bootstrap.directory() / "sitecustomize.py").is_file()
    assert plan.command.env["NPROC_PER_NODE"] == "4"  # PP 2 x EP 2 (x DP 2) on one node
    assert plan.command.argv[:2] == ["megatron", "sft"]


def test_rehearsal_of_the_pretraining_recipe_runs_the_one_megatron_lm_entry_point_with_its_cpu_flag(tmp_path):
    """``python -m elastic_moe_plugin.megatron_lm --cpu SCRIPT`` under torchrun, the recipe's own entry
    point and flags after it; the child bootstrap adds host-tensor clipping for the recipe's --clip-grad."""
    from elastic_moe_plugin.tools import child_bootstrap
    from elastic_moe_plugin.tools.recipes.rehearse import plan_rehearsal
    from elastic_moe_plugin.tools.recipes.render import framework_args

    plan = plan_rehearsal("pretrain/6-10", work_dir=tmp_path / "work", build_assets=False)
    argv = plan.command.argv
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    entry = argv.index("elastic_moe_plugin.megatron_lm")
    assert argv[entry - 1:entry + 2] == ["-m", "elastic_moe_plugin.megatron_lm", "--cpu"]
    assert argv[entry + 2].endswith(".py") and framework_args(plan.command) == argv[entry + 3:]
    assert "--clip-grad" in framework_args(plan.command)
    assert not any("megatron_lm_cpu" in word for word in argv)
    assert plan.command.env[child_bootstrap.BOOTSTRAP_ENV] == "grad_clip"
    assert plan.command.env["PYTHONPATH"].split(os.pathsep)[0] == str(child_bootstrap.directory())


def test_the_package_has_one_cpu_start_up_bootstrap_and_one_megatron_lm_cpu_entry_point():
    """One ``sitecustomize`` in the package, the child bootstrap's; no second Megatron-LM CPU entry."""
    from elastic_moe_plugin.tools import child_bootstrap

    package = REPO / "elastic_moe_plugin"
    assert sorted(package.rglob("sitecustomize.py")) == [child_bootstrap.directory() / "sitecustomize.py"]
    assert not (package / "tools" / "recipes" / "megatron_lm_cpu.py").exists()
    entries = [path for path in package.rglob("*.py") if "runpy.run_module" in path.read_text()]
    assert entries == [], entries


def _bootstrapped(code: str, features: str) -> subprocess.CompletedProcess:
    from elastic_moe_plugin.tools import child_bootstrap

    env = {key: value for key, value in os.environ.items() if key != child_bootstrap.BOOTSTRAP_ENV}
    env.update(child_bootstrap.environment([], str(REPO)), CUDA_VISIBLE_DEVICES="")
    if features:
        env[child_bootstrap.BOOTSTRAP_ENV] = features
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_the_child_bootstrap_switches_on_what_its_variable_names_and_nothing_without_it():
    probe = ("import json, sys; from elastic_moe_plugin.cpu_runtime import grad_clip; "
             "print(json.dumps([grad_clip.is_enabled(), 'torch' in sys.modules]))")
    done = _bootstrapped(probe, "grad_clip")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [True, True]
    # on the path, the variable unset: nothing switched on, not even torch imported
    idle = "import json, sys; print(json.dumps(['elastic_moe_plugin.cpu_runtime' in sys.modules, 'torch' in sys.modules]))"
    done = _bootstrapped(idle, "")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [False, False]


def test_the_child_bootstrap_refuses_a_feature_it_does_not_know():
    from elastic_moe_plugin.tools import child_bootstrap

    done = _bootstrapped("print('ran')", "grad_clip,megatron-swift")
    assert done.returncode != 0 and "ran" not in done.stdout
    assert ("EMOE_BOOTSTRAP='grad_clip,megatron-swift': megatron-swift is no start-up feature; expected a "
            "comma-separated list of megatron_swift, engines, titan, grad_clip, step_probe.") in done.stderr
    with pytest.raises(ValueError, match="megatron-swift is no start-up feature"):
        child_bootstrap.environment(["megatron-swift"])
    # in the order they run, whatever the variable's
    assert child_bootstrap.requested({child_bootstrap.BOOTSTRAP_ENV: " step_probe, megatron_swift"}) == [
        "megatron_swift", "step_probe"]


def test_the_child_bootstrap_runs_the_sitecustomize_it_shadows(tmp_path):
    from elastic_moe_plugin.tools import child_bootstrap

    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_SITECUSTOMIZE_RAN'] = '1'\n")
    env = {key: value for key, value in os.environ.items() if key != child_bootstrap.BOOTSTRAP_ENV}
    env.update(child_bootstrap.environment([], os.pathsep.join([str(tmp_path), str(REPO)])))
    done = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('SHADOWED_SITECUSTOMIZE_RAN'))"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "1"


def test_rehearsal_layer_ranges_scale_to_the_tiny_depth():
    from elastic_moe_plugin.tools.recipes.rehearsal_replacements import scaled_layers

    assert scaled_layers("3-7", 16) == "0-1"
    assert scaled_layers("8-12", 16) == "2-3"
    assert scaled_layers("3-7", 48) == "0"
    assert scaled_layers("0,15", 16) == "0,3"
    assert scaled_layers(None, 16) is None


def test_rehearse_dry_run_through_the_cli(capsys, tmp_path):
    work = tmp_path / "work"
    assert cli.main(["launch", "olmoe_sft/6-10", "--rehearse", "--dry-run", "--rehearse-dir", str(work)]) == 0
    out = capsys.readouterr().out
    assert "# rehearsal of configs/olmoe_sft/6-10.yaml (swift_sft)" in out
    # the recipe's DeepSpeed ZeRO-2 is kept, on 2 CPU ranks, with the CPU settings it needs there
    assert "args.deepspeed" not in out.split("# recipe:")[0] and "--deepspeed zero2" in out
    assert "#   args.use_cpu: unset -> true  (no CUDA here: accelerate's CPU processes over gloo" in out
    assert "#   args.fp16: unset -> false  (ms-swift turns fp16 on for float32 weights" in out
    assert "-> 1 node x 2 CPU processes (gloo)" in out and "EMOE_BOOTSTRAP=engines" in out
    assert "swift sft" in out and "--max_steps 3" in out


def test_rehearse_refuses_a_used_folder_and_steps_without_rehearse(tmp_path, capsys):
    used = tmp_path / "used"
    used.mkdir()
    (used / "left-over").write_text("x")
    assert cli.main(["launch", "olmoe_sft/6-10", "--rehearse", "--rehearse-dir", str(used)]) == 2
    assert "is not empty; a rehearsal starts in a fresh folder" in capsys.readouterr().err
    assert cli.main(["launch", "olmoe_sft/6-10", "--steps", "2", "--dry-run"]) == 2
    assert "--steps and --rehearse-dir belong to a rehearsal: add --rehearse" in capsys.readouterr().err


# ================================================================================== torchtitan (configs/pretrain_titan/)
# Rendering, validation and the rehearsal's plan need no torchtitan; torchtitan's own parsing of every
# recipe and the rehearsal itself are tests/titan/test_titan_rehearse.py (the titan lane).
def test_torchtitan_recipe_dry_run_through_the_cli(monkeypatch):
    _clear_launcher_env(monkeypatch)
    code, out, err = _run_cli("launch", "pretrain_titan/6-10", "--dry-run", "--master-addr", "node0",
                              "--set", "args.dataloader.dataset_path=/data/fineweb-edu", "--", "--training.gc_freq", "100")
    assert code == 0, err
    flat = _flat(out)
    assert ("torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 --master-addr node0 --master-port 29500 "
            "-m torchtitan.train --module elastic_moe_plugin.tools.recipes.titan_models --config eer_1p42b_a365m "
            "--training.local_batch_size 4 --training.global_batch_size 256 --training.seq_len 4096 "
            "--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 16 ") in flat
    for fragment in ("--parallelism.expert_parallel_degree 4", "--dataloader.dataset fineweb_edu",
                     "--dataloader.dataset_path /data/fineweb-edu", "--training.steps 25034",
                     "--training.disable_cuda_graphs", "--optimizer.param_groups.0.optimizer_kwargs.lr 0.00109516",
                     "--optimizer.param_groups.0.optimizer_kwargs.betas 0.9 0.95",
                     "--optimizer.param_groups.0.optimizer_kwargs.weight_decay 0.01", "--lr_scheduler.warmup_steps 251",
                     "--lr_scheduler.decay_ratio 0.0", "--parallelism.spmd_backend partial_dtensor",
                     "--validator.steps 380", "--dump_folder checkpoints/pretrain_titan/6-10", "ELASTIC_MOE_SCHEDULE=6-10"):
        assert fragment in flat, fragment
    assert flat.rstrip().endswith("""--override.imports 'elastic_moe_plugin.titan.elastic_moe={"schedule": "6-10", """
                                  """"sigma": 1.5, "layers": null, "gate": "auto", "sampling": "iid", "mode": "elastic"}' """
                                  "--training.gc_freq 100")
    assert "global batch 256 = micro 4 x DP 16 x accumulation 4" in out
    assert "FSDP over 16 ranks, EP 4 inside them (32 experts per EP rank)" in out


def test_torchtitan_models_are_the_pretraining_recipes_model():
    from elastic_moe_plugin.tools.recipes import titan_models

    megatron = load_recipe("pretrain/6-10").data["model"]
    assert titan_models.ARCHITECTURES["eer_1p42b_a365m"] == {k: v for k, v in megatron.items() if k != "name"}
    for name, path in RECIPES:
        if name.startswith("pretrain_titan/"):
            recipe = load_recipe(path)
            variant = titan_models.CONFIGS[recipe.args["config"]]
            assert variant.facts == {"train_topk": None, **{k: v for k, v in recipe.data["model"].items() if k != "name"}}
            assert variant.expert_bias is (recipe.elastic.mode != "top_p")
            assert recipe.model == load_recipe(f"pretrain/{recipe.name}").model
    tiny = titan_models.ARCHITECTURES[titan_models.TINY]
    assert tiny["topk"] == 8 and tiny["num_experts"] >= 2 * 10 and tiny["num_experts"] % 2 == 0
    assert tiny["num_layers"] == 4 and tiny["vocab_size"] >= 1024  # the rehearsal's depth and tokenizer
    assert [titan_models.tiny_variant(name) for name in ("eer_1p42b_a365m", "eer_1p42b_a365m_top10",
                                                          "eer_1p42b_a365m_no_expert_bias")] == [
        "eer_tiny", "eer_tiny_top10", "eer_tiny_no_expert_bias"]
    for name in titan_models.CONFIGS:  # torchtitan's --config resolves these names in the module
        assert callable(getattr(titan_models, name)) and getattr(titan_models, name).__name__ == name


def test_budget_of_the_torchtitan_recipe_is_the_pretraining_recipes():
    reports = [json.loads(_run_cli("budget", f"configs/{setting}/6-10.yaml", "--json")[1])
               for setting in ("pretrain", "pretrain_titan")]
    for key in ("params", "flops", "tokens", "compute"):
        assert reports[0][key] == reports[1][key], key
    assert reports[1]["params"]["total"] == 1_426_784_256 and reports[1]["tokens"]["warmup_steps"] == 251


@pytest.mark.parametrize("overrides,fragment", [
    (["model.train_topk=10", "elastic.schedule=static"],
     "model.train_topk=10, but args.config eer_1p42b_a365m (configs/pretrain_titan/base.yaml) builds train_topk=None"
     ": torchtitan takes the model from elastic_moe_plugin.tools.recipes.titan_models, not from the model: block; "
     "set args.config: eer_1p42b_a365m_top10."),
    (["model.num_layers=12"], "set model.num_layers: 20 (or register a config there)"),
    (["elastic.mode=top_p", "elastic.top_p=0.4"], "set args.config: eer_1p42b_a365m_no_expert_bias."),
    (["parallel.tp=2"], "parallel.tp=2: the door refuses tensor parallelism"),
    (["parallel.etp=2"], "parallel.etp=2: torchtitan 0.3 has no expert tensor parallelism"),
    (["args.training.seq_len=3"], "args.training.seq_len is rendered from batch.seq_length"),
    (["args.parallelism.expert_parallel_degree=2"], "args.parallelism.expert_parallel_degree is rendered from parallel.ep"),
    (["args.config=eer_2b"], "args.config='eer_2b' is no config of elastic_moe_plugin.tools.recipes.titan_models"),
], ids=["train_topk", "layers", "top_p", "tp", "etp", "seq_len", "ep", "config"])
def test_torchtitan_recipe_mistakes_are_named(overrides, fragment):
    with pytest.raises(RecipeError) as error:
        load_recipe("pretrain_titan/6-10", overrides)
    assert fragment in str(error.value)


def test_rendering_and_planning_a_torchtitan_recipe_import_no_torchtitan(tmp_path):
    probe = (
        "import sys; sys.modules['torchtitan'] = None\n"  # any import of torchtitan fails
        "from elastic_moe_plugin.tools.recipes.load import load_recipe\n"
        "from elastic_moe_plugin.tools.recipes.render import render\n"
        "from elastic_moe_plugin.tools.recipes.rehearse import plan_rehearsal\n"
        "from elastic_moe_plugin.tools.recipes.topology import resolve_topology\n"
        "from elastic_moe_plugin.tools.recipes import titan_models\n"
        "recipe = load_recipe('pretrain_titan/6-10')\n"
        "render(recipe, resolve_topology(recipe, environ={}))\n"
        f"plan_rehearsal('pretrain_titan/top9', work_dir={str(tmp_path / 'work')!r}, build_assets=False)\n"
        "print('rendered', sorted(name for name in sys.modules if name.startswith('torchtitan.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=_clean_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "rendered []"


def test_a_torchtitan_launch_without_torchtitan_names_the_fix(monkeypatch, tmp_path):
    import importlib.util as importlib_util

    find_spec = importlib_util.find_spec
    monkeypatch.setattr(importlib_util, "find_spec", lambda name, *a: None if name == "torchtitan" else find_spec(name, *a))
    _clear_launcher_env(monkeypatch)
    fix = "torchtitan is not importable in this environment: pip install 'elastic-moe-plugin[titan]' (torchtitan>=0.3,<0.4)"
    code, out, err = _run_cli("launch", "pretrain_titan/6-10", "--nnodes", "1", "--nproc-per-node", "8")
    assert code == 2 and f"# WARNING: {fix}; a launch refuses to start" in out and fix in err
    code, out, err = _run_cli("launch", "pretrain_titan/6-10", "--rehearse", "--rehearse-dir", str(tmp_path / "w"))
    assert code == 2 and fix in err


@pytest.mark.parametrize("name,config,layers", [("6-10", "eer_tiny", None), ("top9", "eer_tiny_top9", None),
                                                ("top-p0.4", "eer_tiny_no_expert_bias", None),
                                                ("6-10_L3-7", "eer_tiny", "0-1")])
def test_rehearsal_of_the_torchtitan_recipe_runs_torchtitan_train_under_the_titan_bootstrap(tmp_path, name, config,
                                                                                               layers):
    from elastic_moe_plugin.tools import child_bootstrap
    from elastic_moe_plugin.tools.recipes import titan_models
    from elastic_moe_plugin.tools.recipes.rehearse import plan_rehearsal
    from elastic_moe_plugin.tools.recipes.render import framework_args

    plan = plan_rehearsal(f"pretrain_titan/{name}", work_dir=tmp_path / "work", build_assets=False)
    argv = plan.command.argv
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert argv[argv.index("-m", 3) + 1] == "torchtitan.train" and "--nproc-per-node" in argv
    flags = _flag_values(framework_args(plan.command))
    assert flags["config"] == [config] and flags["module"] == ["elastic_moe_plugin.tools.recipes.titan_models"]
    assert flags["parallelism.expert_parallel_degree"] == ["2"] and flags["parallelism.data_parallel_shard_degree"] == ["2"]
    assert flags["training.steps"] == ["3"] and flags["training.mixed_precision_param"] == ["float32"]
    assert flags["hf_assets_path"] == [str(tmp_path / "work" / "tiny" / "tokenizer")]
    assert flags["dataloader.dataset_path"] == ["data/fineweb-edu/train"]  # written there, in the work folder
    assert plan.command.env[child_bootstrap.BOOTSTRAP_ENV] == "titan"
    assert plan.command.env["PYTHONPATH"].split(os.pathsep)[0] == str(child_bootstrap.directory())
    model = {"train_topk": None, **{k: v for k, v in plan.recipe.data["model"].items() if k != "name"}}
    assert model == titan_models.CONFIGS[config].facts
    assert plan.recipe.elastic.layers == layers
    door = json.loads(flags["override.imports"][0].partition("=")[2])
    assert door["layers"] == layers and door["schedule"] == load_recipe(f"pretrain_titan/{name}").elastic.schedule


def test_the_torchtitan_rehearsal_writes_its_tokenizer_and_data_where_the_recipe_reads_them(tmp_path):
    from elastic_moe_plugin.tools.recipes.rehearse import plan_rehearsal

    work = tmp_path / "work"
    plan = plan_rehearsal("pretrain_titan/6-10", ["args.validator.dataloader.dataset_path=/data/valid"], work_dir=work)
    assert (work / "tiny" / "tokenizer" / "tokenizer.json").is_file()
    assert json.loads((work / "tiny" / "tokenizer" / "tokenizer_config.json").read_text())["eos_token"] == "<|end_of_text|>"
    rows = (work / "data" / "fineweb-edu" / "train" / "data.json").read_text().splitlines()
    assert len(rows) == 600 and set(json.loads(rows[0])) == {"text"}
    # an absolute path of the recipe cannot be written: replaced by a folder of the work folder
    assert plan.recipe.get("args.validator.dataloader.dataset_path") == str(work / "tiny" / "validator.dataloader")
    assert (work / "tiny" / "validator.dataloader" / "data.json").is_file()
    assert any(item.key == "args.validator.dataloader.dataset_path" for item in plan.replacements)
