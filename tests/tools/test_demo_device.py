"""Where the demo trains (``DemoSettings.device``), checked without training anything.

- an unknown device is refused when the settings are made, naming the field, the value, the
  accepted values and a fix that is itself accepted;
- ``device="cuda"`` on a machine without CUDA is refused by the demo's real entry
  (:func:`~elastic_moe_plugin.tools.demo.train.train_runs`) before anything is loaded: neither
  Megatron nor the CPU runtime (a GPU run never loads it, so the refusal must come first);
- the output files record the device.

The CPU path itself is the demo's (tests/tools/test_demo.py); the CUDA path needs a GPU
(``scripts/gpu_check.sh``, section compare_study).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from elastic_moe_plugin.core.config import ElasticConfig
from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.tools.demo import device
from elastic_moe_plugin.tools.demo.settings import DEVICES, DemoSettings

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")

#: the smallest settings the entry accepts: the refusal must come before they matter
TINY = dict(steps=1, batch_size=2, heldout_sequences=4, eval_points=1)


@pytest.mark.parametrize("value", ["tpu", "CUDA", "cuda:0", ""])
def test_an_unknown_device_is_refused_with_the_accepted_values_and_a_fix(value):
    with pytest.raises(ConfigError) as info:
        DemoSettings(device=value)
    message = str(info.value)
    assert f"device={value!r} is not a device the demo trains on" in message
    assert "expected one of 'cpu', 'cuda'" in message and "--device cpu" in message
    assert info.value.field == "device"
    assert info.value.fixes == ({"device": "cpu"},)
    assert DemoSettings(**info.value.fixes[0]).device == "cpu"
    with pytest.raises(ConfigError, match="is not a device the demo trains on"):
        dataclasses.replace(DemoSettings(), device=value)  # replace() checks too
    assert DEVICES == ("cpu", "cuda")


def _tiny_entry_arguments(settings: DemoSettings):
    from elastic_moe_plugin.tools.demo.corpus import synthetic_corpus
    from elastic_moe_plugin.tools.demo.model import model_config

    corpus = synthetic_corpus(settings)
    return {"static": ElasticConfig(schedule="static")}, settings, corpus, model_config(settings, corpus.vocab_size)


@no_cuda
def test_cuda_without_a_cuda_device_is_refused_by_the_demo_entry():
    from elastic_moe_plugin.tools.demo.train import train_runs

    settings = DemoSettings(device="cuda", **TINY)
    with pytest.raises(ConfigError) as info:
        train_runs(*_tiny_entry_arguments(settings))
    message = str(info.value)
    assert message.startswith("device='cuda' (--device cuda) trains on a CUDA GPU, and this machine has none")
    assert f"torch {torch.__version__} (CUDA build: " in message  # what was found
    assert "torch.cuda.is_available() is False" in message
    assert "Train on the CPU with --device cpu (device='cpu')" in message
    assert info.value.field == "device" and info.value.fixes == ({"device": "cpu"},)
    fixed = dataclasses.replace(settings, **info.value.fixes[0])
    device.check_available(fixed.device)  # the fix is accepted where the refusal came from


@no_cuda
def test_the_cuda_refusal_comes_before_megatron_or_the_cpu_runtime_loads():
    """In a fresh interpreter: after the refusal, no module of Megatron or of the CPU runtime is loaded."""
    code = (
        "import sys\n"
        "from elastic_moe_plugin.core.config import ElasticConfig\n"
        "from elastic_moe_plugin.core.errors import ConfigError\n"
        "from elastic_moe_plugin.tools.demo.corpus import synthetic_corpus\n"
        "from elastic_moe_plugin.tools.demo.model import model_config\n"
        "from elastic_moe_plugin.tools.demo.settings import DemoSettings\n"
        "from elastic_moe_plugin.tools.demo.train import train_runs\n"
        f"settings = DemoSettings(device='cuda', **{TINY!r})\n"
        "corpus = synthetic_corpus(settings)\n"
        "try:\n"
        "    train_runs({'static': ElasticConfig(schedule='static')}, settings, corpus,\n"
        "               model_config(settings, corpus.vocab_size))\n"
        "except ConfigError as error:\n"
        "    print('refused:', error)\n"
        "prefixes = ('megatron', 'elastic_moe_plugin.cpu_runtime')\n"
        "print('loaded:', sorted(m for m in sys.modules if m.startswith(prefixes)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "refused: device='cuda' (--device cuda)" in result.stdout
    assert "loaded: []" in result.stdout, result.stdout


def test_the_output_files_record_the_device():
    from elastic_moe_plugin.tools.demo.corpus import synthetic_corpus
    from elastic_moe_plugin.tools.demo.model import model_config
    from elastic_moe_plugin.tools.demo.report import model_config_file

    settings = DemoSettings(**TINY)
    corpus = synthetic_corpus(settings)
    results = {"static": {"elastic_config": ElasticConfig(schedule="static").to_dict()}}
    described = model_config_file(model_config(settings, corpus.vocab_size), settings, corpus, results, "0.0")
    assert described["device"] == "cpu" and "device_name" not in described
    assert device.device_entry("cpu") == {"device": "cpu"}
    assert device.torch_device("cpu") == torch.device("cpu")
