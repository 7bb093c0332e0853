"""Every fix a ConfigError suggests is accepted when fed back, in the form the user wrote the setting.

Each case is a refused setting as a user meets it: variables (``ELASTIC_MOE_*``, as the ms-swift
plugin reads them, with the model's shape read from its config.json) against a model (top-k,
experts, layers). The message must show every fix of ``error.fixes`` spelled as a variable; setting
that variable (the text from the message, split at ``=``) must then give a config the same model
accepts. ``test_fix_round_trip.py`` holds every other entry point to the same rule.
"""

from __future__ import annotations

import argparse

import pytest

from elastic_moe_plugin import ConfigError, ElasticConfig
from elastic_moe_plugin.core.config import ModelShape, Spelling, add_cli_arguments, config_from_cli

#: (variables, model (num_experts, topk, num_layers), what the message must say, fixes it must offer)
REFUSED = {
    "7-12 on top-8": ({"ELASTIC_MOE_SCHEDULE": "7-12"}, (64, 8, 16), "has mean",
                      [{"schedule": "6-10"}, {"allow_off_center": True}]),
    "0-16 on top-8": ({"ELASTIC_MOE_SCHEDULE": "0-16"}, (64, 8, 16), "low must be >= 1", [{"schedule": "1-15"}]),
    "the default on top-1": ({}, (8, 1, 2), "ELASTIC_MOE_SCHEDULE unset (the default, 'auto'",
                             [{"schedule": "static"}, {"schedule": "1-3", "allow_off_center": True}]),
    "6-10 on top-2": ({"ELASTIC_MOE_SCHEDULE": "6-10"}, (8, 2, 2), "does not contain the model's top-2",
                      [{"schedule": "1-3"}]),
    "1-4 on top-2": ({"ELASTIC_MOE_SCHEDULE": "1-4"}, (8, 2, 2), "has mean", [{"schedule": "1-3"}, {"allow_off_center": True}]),
    "9-7 reversed": ({"ELASTIC_MOE_SCHEDULE": "9-7"}, (64, 8, 16), "low=9 > high=7", [{"schedule": "7-9"}]),
    "11-5 reversed": ({"ELASTIC_MOE_SCHEDULE": "11-5"}, (64, 8, 16), "low=11 > high=5", [{"schedule": "5-11"}]),
    "6-10 on 8 experts": ({"ELASTIC_MOE_SCHEDULE": "6-10"}, (8, 8, 2), "only 8 experts", [{"schedule": "static"}]),
    "5-11 on 10 experts": ({"ELASTIC_MOE_SCHEDULE": "5-11"}, (10, 8, 2), "only 10 experts", [{"schedule": "6-10"}]),
    "unparsable": ({"ELASTIC_MOE_SCHEDULE": "six-ten"}, (64, 8, 16), "does not parse", [{"schedule": "static"}]),
    "point mass off top-k": ({"ELASTIC_MOE_SCHEDULE": "9"}, (64, 8, 16), "point mass at 9", [{"schedule": "static"}]),
    "center off top-k": ({"ELASTIC_MOE_CENTER": "5", "ELASTIC_MOE_SCHEDULE": "3-7"}, (64, 8, 16), "routes to top-8",
                         [{"center": None, "schedule": "6-10"}, {"center": 8, "schedule": "6-10"}]),
    "center outside the range": ({"ELASTIC_MOE_CENTER": "5", "ELASTIC_MOE_SCHEDULE": "6-10"}, (64, 5, 16),
                                 "does not contain the model's top-5",
                                 [{"schedule": "3-7"}]),
    "mode": ({"ELASTIC_MOE_MODE": "nucleus"}, (64, 8, 16), "not a router mode",
                [{"mode": "elastic"}, {"mode": "top_p"}]),
    "layers outside": ({"ELASTIC_MOE_LAYERS": "3-7"}, (64, 8, 6), "selects layer(s) [6, 7]",
                       [{"layers": "3-5"}, {"layers": None}]),
    "top-p cap": ({"ELASTIC_MOE_MODE": "top_p", "ELASTIC_MOE_TOP_P_MAX_EXPERTS": "100"}, (64, 8, 16), "exceeds",
                  [{"top_p_max_experts": 64}, {"top_p_max_experts": None}]),
    "balanced off centre": ({"ELASTIC_MOE_SCHEDULE": "7-10", "ELASTIC_MOE_ALLOW_OFF_CENTER": "1",
                             "ELASTIC_MOE_SAMPLING": "balanced"}, (64, 8, 16), "needs a schedule symmetric",
                            [{"sampling": "iid"}, {"schedule": "7-9"}]),
    "sigma": ({"ELASTIC_MOE_SIGMA": "0"}, (64, 8, 16), "expected a finite number > 0", [{"sigma": 1.5}]),
    "gate": ({"ELASTIC_MOE_GATE": "softmax"}, (64, 8, 16), "not a gate convention",
             [{"gate": "auto"}, {"gate": "full_softmax"}, {"gate": "renormalized"}]),
}


def _refusal(environ: dict[str, str], model: tuple[int, int, int]) -> ConfigError:
    num_experts, topk, num_layers = model
    with pytest.raises(ConfigError) as caught:
        ElasticConfig.from_env(environ, model=ModelShape(topk, num_experts, num_layers))
    return caught.value


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_every_suggested_fix_is_accepted(case):
    environ, model, says, expected_fixes = REFUSED[case]
    error = _refusal(environ, model)
    message = str(error)
    assert says in message, message
    assert [dict(fix) for fix in error.fixes] == expected_fixes, message
    num_experts, topk, num_layers = model
    for fix in error.fixes:
        # the fix as the message spells it, pasted back as variables
        texts = [Spelling("env").setting(name, value) for name, value in fix.items()]
        for text in texts:
            assert text in message, (text, message)
        fixed = dict(environ)
        fixed.update(text.split("=", 1) for text in texts)
        ElasticConfig.from_env(fixed).resolve(num_experts=num_experts, topk=topk, num_layers=num_layers)


def test_messages_name_variables_not_python_fields():
    message = str(_refusal({"ELASTIC_MOE_SCHEDULE": "7-12"}, (64, 8, 16)))
    assert "ELASTIC_MOE_SCHEDULE=7-12" in message and "ELASTIC_MOE_ALLOW_OFF_CENTER=1" in message
    assert "allow_off_center=True" not in message and "schedule='7-12'" not in message


def test_python_yaml_and_flags_are_spelled_as_written(tmp_path):
    with pytest.raises(ConfigError, match=r"schedule='7-12' around the model's top-8 .* or set allow_off_center=True"):
        ElasticConfig(schedule="7-12").resolve(num_experts=64, topk=8)
    path = tmp_path / "elastic.yaml"
    path.write_text("schedule: 7-12\n")
    with pytest.raises(ConfigError, match=r"schedule: 7-12 around .* e\.g\. schedule: 6-10, or set allow_off_center: true"):
        ElasticConfig.from_yaml(path).resolve(num_experts=64, topk=8)
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    args = parser.parse_args(["--elastic-moe-schedule", "7-12"])
    with pytest.raises(ConfigError, match=r"--elastic-moe-schedule 7-12 around .* --elastic-moe-schedule 6-10, or set "
                                          r"--elastic-moe-allow-off-center true"):
        config_from_cli(args, environ={}).resolve(num_experts=64, topk=8)


def test_a_default_schedule_is_called_the_default():
    """The default is resolved from the model; where none exists (top-1) the message says the
    variable is unset and names what to set."""
    message = str(_refusal({}, (8, 1, 2)))
    assert message.startswith("environment: ELASTIC_MOE_SCHEDULE unset (the default, 'auto': k-2..k+2 around "
                              "the model's top-k): the model routes to top-1"), message
    assert "ELASTIC_MOE_SCHEDULE=static" in message
    assert "ELASTIC_MOE_SCHEDULE=1-3 and ELASTIC_MOE_ALLOW_OFF_CENTER=1" in message


@pytest.mark.parametrize(("topk", "num_experts", "expected"), [(2, 8, "1-3"), (4, 8, "2-6"), (8, 64, "6-10"),
                                                               (8, 9, "7-9"), (3, 4, "2-4"), (2, 2, None),
                                                               (1, 8, None), (16, 128, "14-18")])
def test_the_default_is_resolved_from_the_model(topk, num_experts, expected):
    """k-2..k+2, kept symmetric and within 1..E: narrowed where k-2 < 1 or k+2 > E."""
    config = ElasticConfig()
    assert config.auto_range(topk, num_experts) == expected
    if expected is None:
        with pytest.raises(ConfigError, match="no elastic"):
            config.resolve(num_experts=num_experts, topk=topk)
    else:
        low, high = map(int, expected.split("-"))
        schedule = config.resolve(num_experts=num_experts, topk=topk)
        assert (schedule.low, schedule.high, schedule.center) == (low, high, topk) and schedule.is_symmetric


def test_a_reversed_range_that_does_not_fit_the_center_is_refused_with_a_fix_around_it():
    """No model yet, a center set: the turned-round range is checked against the center (this
    used to raise AttributeError, naming no setting)."""
    with pytest.raises(ConfigError, match=r"6-10 does not fit center=4 either\. Use schedule='2-6'") as raised:
        ElasticConfig.from_dict({"schedule": "10-6", "center": 4})
    assert raised.value.fixes[0] == {"schedule": "2-6"}
    assert ElasticConfig.from_dict({"schedule": "2-6", "center": 4}).schedule == "2-6"
