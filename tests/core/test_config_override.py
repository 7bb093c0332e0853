"""torchtitan's override entry as a config source: ``config_from_override`` (the JSON keyword
arguments of ``--override.imports 'elastic_moe_plugin.titan.elastic_moe={...}'``), its precedence
over the environment and YAML, and its spelling in messages."""

from __future__ import annotations

import pytest

from elastic_moe_plugin.core.config import ElasticConfig, config_from_override
from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.core.spelling import Spelling


def test_the_json_object_wins_over_the_environment_and_yaml(tmp_path):
    recipe = tmp_path / "elastic.yaml"
    recipe.write_text("schedule: 5-11\nsigma: 3.0\nlayers: 3-7\n")
    environ = {"ELASTIC_MOE_SIGMA": "2.0", "ELASTIC_MOE_CONFIG": str(recipe)}
    config = config_from_override({"schedule": "6-10"}, environ)
    assert config == ElasticConfig(schedule="6-10", sigma=2.0, layers="3-7")
    assert config_from_override({"config": str(recipe)}, {}) == ElasticConfig(schedule="5-11", sigma=3.0, layers="3-7")
    assert config_from_override({}, {}) == ElasticConfig()


def test_json_values_are_typed_and_words_are_read_as_text():
    config = config_from_override({"center": "auto", "layers": 4, "enabled": True, "sigma": 1, "log_metrics": False}, {})
    assert (config.center, config.layers, config.enabled, config.sigma, config.log_metrics) == (None, "4", True, 1, "off")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"schedul": "6-10"}, """unknown key(s) 'schedul' (did you mean 'schedule'?)"""),
        ({"sigma": -1}, '''"sigma": -1 is invalid: expected a finite number > 0. Use "sigma": 1.5'''),
        ({"layers": "7-3"}, '"layers": "7-3"'),
    ],
)
def test_errors_name_the_setting_in_json(fields, message):
    with pytest.raises(ConfigError) as caught:
        config_from_override(fields, {})
    assert str(caught.value).startswith("torchtitan --override.imports: ")
    assert message in str(caught.value)


def test_the_override_spelling_writes_json():
    spelled = Spelling("override")
    assert spelled.setting("schedule", "6-10") == '"schedule": "6-10"'
    assert spelled.setting("center", None) == '"center": "auto"'
    assert spelled.setting("enabled", False) == '"enabled": false'
    assert spelled.setting("sigma", 1.5) == '"sigma": 1.5'
    assert spelled.unset("layers") == 'no "layers" key'
