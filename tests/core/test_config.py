"""ElasticConfig: one validated source of truth across Python, YAML, environment and CLI flags."""

import argparse

import pytest

from elastic_moe_plugin import BudgetSchedule, ConfigError, ElasticConfig
from elastic_moe_plugin.core.config import ENV_VARS, add_cli_arguments, config_from_cli, parse_layers


def test_defaults_are_the_papers():
    config = ElasticConfig()
    # the schedule is resolved from the model: k-2..k+2, the paper's 6-10 at top-8
    assert (config.schedule, config.center, config.sigma, config.layers) == ("auto", None, 1.5, None)
    assert (config.gate, config.sampling, config.enabled) == ("auto", "iid", True)
    assert config.budget_schedule(8) == BudgetSchedule(6, 10, 8, 1.5)
    assert config.resolve(num_experts=64, topk=8) == BudgetSchedule(6, 10, 8, 1.5)
    assert config.layer_is_elastic(0) and config.layer_is_elastic(47)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("3-7", {3, 4, 5, 6, 7}), ("0,2,5-7", {0, 2, 5, 6, 7}), ("4", {4}), (" 1 - 2 , 9", {1, 2, 9}), ("0-0", {0})],
)
def test_parse_layers(spec, expected):
    assert parse_layers(spec) == frozenset(expected)
    config = ElasticConfig(layers=spec)
    assert {i for i in range(12) if config.layer_is_elastic(i)} == expected


@pytest.mark.parametrize("spec", ["", "3-", "-3", "a-b", "3..7", "1,,2", "7-3", "L3-L7"])
def test_malformed_layers(spec):
    with pytest.raises(ConfigError, match=r"layers="):
        ElasticConfig(layers=spec)


def test_disabled_config_routes_nothing_elastically():
    assert not ElasticConfig(enabled=False).layer_is_elastic(0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule": "0-4"}, r"schedule='0-4' is invalid: low=0, but every token needs at least one expert"),
        ({"schedule": "11-5"}, r"low=11 > high=5"),
        ({"schedule": "x"}, r"schedule='x' does not parse"),
        ({"schedule": ""}, r"schedule='' is invalid"),
        ({"schedule": "6-10", "center": 5}, r"schedule='6-10' does not contain the model's top-5"),
        ({"sigma": 0.0}, r"sigma=0.0 is invalid"),
        ({"sigma": float("nan")}, r"sigma=nan is invalid"),
        ({"center": 0}, r"center=0 is invalid"),
        ({"gate": "softmax"}, r"gate='softmax' is not a gate convention.*full_softmax"),
        ({"sampling": "stratified"}, r"sampling='stratified' is not a sampling mode.*balanced"),
        ({"enabled": "yes"}, r"enabled='yes' is not true or false: expected one of enabled=True, enabled=False"),
        ({"mode": "nucleus"}, r"mode='nucleus' is not a router mode.*top_p"),
        ({"mode": "top_p", "top_p": 0.0}, r"top_p=0.0 is invalid: expected a number in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p=1.5 is invalid"),
        ({"top_p_max_experts": 0}, r"top_p_max_experts=0 is invalid"),
        ({"log_metrics": "verbose"}, r"log_metrics='verbose' is not a metrics layout: expected log_metrics='layers'"),
        ({"log_metrics": False}, r"log_metrics=False is not a metrics layout.*log_metrics='off' \(none\)\.$"),
    ],
)
def test_bad_values_raise_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ElasticConfig(**kwargs)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_resolve_against_a_model():
    config = ElasticConfig(layers="3-7")
    assert config.resolve(num_experts=64, topk=8, num_layers=16) == BudgetSchedule(6, 10, 8)
    with pytest.raises(ConfigError, match=r"selects layer\(s\) \[6, 7\], but the model has 6 decoder layers"):
        config.resolve(num_experts=64, topk=8, num_layers=6)
    with pytest.raises(ConfigError, match=r"reaches budget 10, but the model has only 8 experts"):
        ElasticConfig(schedule="6-10").resolve(num_experts=8, topk=8)
    with pytest.raises(ConfigError, match=r"center=8, but the model routes to top-2"):
        ElasticConfig(center=8).resolve(num_experts=64, topk=2)
    with pytest.raises(ConfigError, match=r"point mass at 8, but the model routes to top-2"):
        ElasticConfig(schedule="8").resolve(num_experts=64, topk=2)
    with pytest.raises(ConfigError, match=r"schedule='1-4' around the model's top-2 has mean 2.2729, not 2"):
        ElasticConfig(schedule="1-4").resolve(num_experts=8, topk=2)


def test_resolve_keeps_a_shape_that_passed_and_checks_every_other_one_each_time():
    config = ElasticConfig(layers="3-7")
    first = config.resolve(num_experts=64, topk=8, num_layers=16)
    assert config.resolve(num_experts=64, topk=8, num_layers=16) is first  # kept, not built again
    assert config.resolve(num_experts=64, topk=2, num_layers=16) == BudgetSchedule(1, 3, 2)  # another shape
    for _ in range(2):  # a refused shape is refused again: errors are never kept
        with pytest.raises(ConfigError, match=r"selects layer\(s\) \[6, 7\]"):
            config.resolve(num_experts=64, topk=8, num_layers=6)
    # the memo is the instance's: an equal config resolves on its own, and replace() starts empty
    assert ElasticConfig(layers="3-7").resolve(num_experts=64, topk=8, num_layers=16) is not first
    assert config.replace(sigma=3.0).resolve(num_experts=64, topk=8, num_layers=16) == BudgetSchedule(6, 10, 8, 3.0)
    assert config == ElasticConfig(layers="3-7")  # the memo is not compared


def test_yaml_round_trip(tmp_path):
    path = tmp_path / "elastic.yaml"
    path.write_text("schedule: 5-11\nsigma: 3.0\nlayers: '3-7'\ngate: renormalized\nsampling: balanced\n")
    config = ElasticConfig.from_yaml(path)
    assert config == ElasticConfig(schedule="5-11", sigma=3.0, layers="3-7", gate="renormalized", sampling="balanced")
    nested = tmp_path / "nested.yaml"
    nested.write_text("elastic_moe:\n  schedule: 7-9\n")
    assert ElasticConfig.from_yaml(nested).schedule == "7-9"


def test_yaml_errors_name_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("schedul: 6-10\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key\(s\) 'schedul' \(did you mean 'schedule'\?\)"):
        ElasticConfig.from_yaml(path)
    path.write_text("schedule: 11-5\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: schedule: 11-5 has low=11 > high=5"):
        ElasticConfig.from_yaml(path)
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"expected a mapping"):
        ElasticConfig.from_yaml(path)
    path.write_text("schedule: [unclosed\n")
    with pytest.raises(ConfigError, match=r"not valid YAML"):
        ElasticConfig.from_yaml(path)
    with pytest.raises(ConfigError, match=r"does not exist"):
        ElasticConfig.from_yaml(tmp_path / "missing.yaml")
    # safe loading: no arbitrary Python objects
    path.write_text("schedule: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match=r"not valid YAML"):
        ElasticConfig.from_yaml(path)


def test_env_variables_cover_every_field():
    assert set(ENV_VARS.values()) == {
        "ELASTIC_MOE_SCHEDULE", "ELASTIC_MOE_CENTER", "ELASTIC_MOE_SIGMA", "ELASTIC_MOE_LAYERS",
        "ELASTIC_MOE_GATE", "ELASTIC_MOE_SAMPLING", "ELASTIC_MOE_ENABLED", "ELASTIC_MOE_ALLOW_OFF_CENTER",
        "ELASTIC_MOE_MODE", "ELASTIC_MOE_TOP_P", "ELASTIC_MOE_TOP_P_MAX_EXPERTS", "ELASTIC_MOE_ALLOW_UNCOVERED_ROUTERS",
        "ELASTIC_MOE_LOG_METRICS",
    }


def test_from_env():
    environ = {
        "ELASTIC_MOE_SCHEDULE": "7-9", "ELASTIC_MOE_CENTER": "8", "ELASTIC_MOE_SIGMA": "1.0",
        "ELASTIC_MOE_LAYERS": "3-7", "ELASTIC_MOE_GATE": "full_softmax", "ELASTIC_MOE_SAMPLING": "balanced",
        "ELASTIC_MOE_ENABLED": "false", "UNRELATED": "x",
    }
    assert ElasticConfig.from_env(environ) == ElasticConfig(
        schedule="7-9", center=8, sigma=1.0, layers="3-7", gate="full_softmax", sampling="balanced", enabled=False
    )
    assert ElasticConfig.from_env({}) == ElasticConfig()
    assert ElasticConfig.from_env({"ELASTIC_MOE_LAYERS": "all", "ELASTIC_MOE_CENTER": "auto"}) == ElasticConfig()


def test_operational_variables_are_not_config_errors():
    environ = {"ELASTIC_MOE_ALLOW_UNSUPPORTED_MCORE": "1", "ELASTIC_MOE_ALLOW_UNSUPPORTED_TRANSFORMERS": "1",
               "ELASTIC_MOE_DEBUG": "1", "ELASTIC_MOE_SWIFT_HOOK": "0", "ELASTIC_MOE_SCHEDULE": "7-9"}
    assert ElasticConfig.from_env(environ) == ElasticConfig(schedule="7-9")


def test_top_p_from_env():
    config = ElasticConfig.from_env({"ELASTIC_MOE_MODE": "top_p", "ELASTIC_MOE_TOP_P": "0.4", "ELASTIC_MOE_TOP_P_MAX_EXPERTS": "16"})
    assert (config.mode, config.top_p, config.top_p_max_experts) == ("top_p", 0.4, 16)
    with pytest.raises(ConfigError, match=r"ELASTIC_MOE_TOP_P_MAX_EXPERTS=many is invalid"):
        ElasticConfig.from_env({"ELASTIC_MOE_TOP_P_MAX_EXPERTS": "many"})


def test_env_over_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("schedule: 5-11\nlayers: 3-7\n")
    config = ElasticConfig.from_env({"ELASTIC_MOE_CONFIG": str(path), "ELASTIC_MOE_SCHEDULE": "7-9"})
    assert (config.schedule, config.layers) == ("7-9", "3-7")


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"ELASTIC_MOE_SCHEDULE": "11-5"}, r"environment: ELASTIC_MOE_SCHEDULE=11-5 has low=11 > high=5"),
        ({"ELASTIC_MOE_SIGMA": "wide"}, r"ELASTIC_MOE_SIGMA=wide is invalid"),
        ({"ELASTIC_MOE_CENTER": "eight"}, r"ELASTIC_MOE_CENTER=eight is invalid"),
        ({"ELASTIC_MOE_ENABLED": "maybe"}, r"ELASTIC_MOE_ENABLED=maybe is invalid"),
        ({"ELASTIC_MOE_GATE": "topk"}, r"ELASTIC_MOE_GATE=topk is not a gate convention"),
        ({"ELASTIC_MOE_SAMPLIN": "iid"}, r"ELASTIC_MOE_SAMPLIN is not an elastic-moe setting \(did you mean ELASTIC_MOE_SAMPLING\?\)"),
        ({"ELASTIC_MOE_CONFIG": "/nonexistent/x.yaml"}, r"does not exist"),
    ],
)
def test_env_errors(environ, message):
    with pytest.raises(ConfigError, match=message):
        ElasticConfig.from_env(environ)


def test_cli_flags_map_onto_the_same_config(tmp_path):
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    path = tmp_path / "c.yaml"
    path.write_text("schedule: 5-11\nsigma: 3.0\n")
    args = parser.parse_args(["--elastic-moe-config", str(path), "--elastic-moe-layers", "3-7", "--elastic-moe-sampling", "balanced"])
    config = config_from_cli(args, environ={"ELASTIC_MOE_SIGMA": "1.0"})
    assert config == ElasticConfig(schedule="5-11", sigma=1.0, layers="3-7", sampling="balanced")
    bad = parser.parse_args(["--elastic-moe-schedule", "11-5"])
    with pytest.raises(ConfigError, match=r"command line: --elastic-moe-schedule 11-5 has low=11 > high=5"):
        config_from_cli(bad, environ={})


def test_log_metrics_reads_the_same_in_every_entry_point(tmp_path):
    """``layers`` (the default) / ``means`` / ``off``; the Megatron-LM entry point's old booleans read as
    ``layers`` (true) and ``off`` (false) in every text entry point, YAML's typed booleans too (YAML reads
    a bare ``off`` as false); Python takes the words only."""
    assert ElasticConfig().log_metrics == "layers"
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    for text, expected in [("layers", "layers"), ("Means", "means"), ("off", "off"), ("true", "layers"),
                           ("1", "layers"), ("on", "layers"), ("false", "off"), ("0", "off"), ("no", "off")]:
        assert ElasticConfig.from_env({"ELASTIC_MOE_LOG_METRICS": text}).log_metrics == expected, text
        flags = parser.parse_args(["--elastic-moe-log-metrics", text])
        assert config_from_cli(flags, environ={}).log_metrics == expected, text
        path = tmp_path / "c.yaml"
        path.write_text(f"log_metrics: {text}\n")
        assert ElasticConfig.from_yaml(path).log_metrics == expected, text
    with pytest.raises(ConfigError, match=r"^environment: ELASTIC_MOE_LOG_METRICS=verbose is not a metrics layout: "
                                          r"expected ELASTIC_MOE_LOG_METRICS=layers .*; true and false read as layers"):
        ElasticConfig.from_env({"ELASTIC_MOE_LOG_METRICS": "verbose"})
    with pytest.raises(ConfigError, match=r"--elastic-moe-log-metrics maybe is not a metrics layout") as caught:
        config_from_cli(parser.parse_args(["--elastic-moe-log-metrics", "maybe"]), environ={})
    assert caught.value.field == "log_metrics"
    assert caught.value.fixes == ({"log_metrics": "layers"}, {"log_metrics": "means"}, {"log_metrics": "off"})
    help_text = " ".join(parser.format_help().split())
    assert "ElasticConfig.log_metrics: layers, means, off (env ELASTIC_MOE_LOG_METRICS)" in help_text


def test_log_metrics_is_operational_it_changes_no_routing():
    """Every value resolves the same schedule and layers, reads back from the variables the recipes render,
    and configs that differ only in it differ as configs (so that applying one of them takes effect)."""
    from elastic_moe_plugin.core.config import OPERATIONAL_ENV_VARS, log_layout

    base = ElasticConfig(schedule="6-10", layers="3-7")
    for layout in ("layers", "means", "off"):
        config = base.replace(log_metrics=layout)
        assert config.resolve(num_experts=64, topk=8, num_layers=16) == base.resolve(num_experts=64, topk=8, num_layers=16)
        assert config.layer_set == base.layer_set and config.budget_schedule(8) == base.budget_schedule(8)
        assert ElasticConfig.from_env({"ELASTIC_MOE_LOG_METRICS": layout}).log_metrics == layout
        assert (config == base) == (layout == "layers")
    assert "ELASTIC_MOE_LOG_METRICS" not in OPERATIONAL_ENV_VARS  # a field, read with the others
    # what a logging step writes: `layers` follows the framework's per-layer switch, `means` never logs per layer
    assert [log_layout("layers", True), log_layout("layers", False)] == ["layers", "means"]
    assert [log_layout("means", True), log_layout("off", True), log_layout(None, True)] == ["means", "off", "layers"]

