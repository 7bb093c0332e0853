"""What Megatron-LM's flags decide is refused before the training script runs (``mcore.megatron_args``).

- The flags are read with Megatron-LM's names, types and defaults: checked against the installed
  ``TransformerConfig`` (both megatron-core versions) and against Megatron-LM's own parser
  (``megatron.training.arguments``, where it imports with the megatron-core it belongs to).
- Each refusal the flags decide, through ``parse_argv`` + ``check_megatron_args`` (what
  ``python -m elastic_moe_plugin.megatron_lm`` runs first): the schedule's centre against
  ``--moe-router-topk``, the layers against ``--num-layers``, ``--batch-invariant-mode``,
  ``--moe-apply-probs-on-input``, a CUDA graph of the router, ``--moe-enable-routing-replay``, sinkhorn / quantile_balancing, ``--transformer-impl
  inference_optimized``, group-limited routing too narrow for the schedule; applying the fix the
  message names (remove the flag, or the value it gives) is accepted. Command lines that do not
  decide the model are left to model build.
- Through the real entry point, in a subprocess that spies on ``torch.distributed.init_process_group``:
  every refusal exits with status 2 and its message before any process group exists and before
  ``megatron`` is even imported; with the same command line and no bad flag, the script does reach
  ``init_process_group`` (the control: the spy is wired where Megatron-LM initialises).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_moe_plugin import ConfigError
from elastic_moe_plugin.core.config_refusals import ModelShape
from elastic_moe_plugin.core.errors import UnsupportedMegatronError
# _parser: "the mirror" below is the unit test of this private parser itself (its flags against Megatron's)
from elastic_moe_plugin.mcore.megatron_args import _parser, check_megatron_args, megatron_options, model_shape
from elastic_moe_plugin.megatron_lm import parse_argv

pytestmark = [pytest.mark.megatron]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "megatron_lm" / "pretrain_gpt_moe.py"
#: a tiny MoE GPT that Megatron-LM's trainer runs on CPU (as tests/mcore/test_megatron_lm.py): 2 layers, 4 experts, top-2
MEGATRON_ARGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
    "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "0.01", "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "2",
    "--lr", "1e-3", "--seed", "1234", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--num-workers", "0",
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-bias-gelu-fusion", "--disable-bias-linear",
    "--clip-grad", "0",  # the CPU runtime refuses clipping (it asserts CUDA tensors)
]


def _without(args: list[str], flag: str, values: int = 1) -> list[str]:
    i = args.index(flag)
    return args[:i] + args[i + 1 + values:]


def _with(args: list[str], flag: str, *value: str) -> list[str]:
    """``args`` with every ``flag`` (and its values) taken out, then ``flag value`` appended."""
    while flag in args:
        i = args.index(flag)
        end = i + 1
        while end < len(args) and not args[end].startswith("--"):
            end += 1
        args = args[:i] + args[end:]
    return [*args, flag, *value]


def _check(args: list[str]):
    launch = parse_argv([str(SCRIPT), *args], environ={})
    check_megatron_args(launch.config, launch.megatron_args)
    return launch


# ====================================================================================== the mirror
def test_the_flags_have_the_defaults_of_transformer_config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)
                if f.default is not dataclasses.MISSING}
    parsed = vars(_parser().parse_args([]))
    # Megatron-LM's argparse default differs from the dataclass's for these (argparse_meta / own flags)
    argparse_only = {"num_layers", "cuda_graph_modules", "cuda_graph_scope"}
    compared = [name for name in parsed if name in defaults and name not in argparse_only]
    assert len(compared) >= 10, compared
    for name in compared:
        assert parsed[name] == defaults[name], (name, parsed[name], defaults[name])


def _megatron_lm_parser():
    core = importlib.util.find_spec("megatron.core")
    training = importlib.util.find_spec("megatron.training")
    if training is None or Path(core.origin).parents[1] != Path(training.origin).parents[1]:
        pytest.skip("no megatron.training of the imported megatron.core (the 0.16.1 wheel ships none)")
    import argparse

    from elastic_moe_plugin.cpu_runtime import megatron_training

    megatron_training.enable()  # typing.override on Python 3.11 (the 0.19.2 wheel's megatron.training)
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def test_the_flags_are_megatron_lms_own():
    """Every flag read is one of Megatron-LM's, with its dest, its arity and its default."""
    theirs = _megatron_lm_parser()
    their_defaults = vars(theirs.parse_args([]))
    for action in _parser()._actions:  # noqa: SLF001 - argparse's own table
        for option in action.option_strings:
            assert option in theirs._option_string_actions, option  # noqa: SLF001
            their = theirs._option_string_actions[option]  # noqa: SLF001
            assert their.nargs == action.nargs, (option, their.nargs, action.nargs)
            # megatron-core 0.19's Megatron-LM keeps the deprecated --cuda-graph-scope under another dest
            dest = {"num_moe_experts": "num_experts"}.get(action.dest, action.dest)
            assert their.dest in (dest, f"{dest}_deprecated"), (option, their.dest)
            dest = their.dest
            if action.dest not in ("cuda_graph_modules", "cuda_graph_scope"):  # merged by megatron_options
                assert their_defaults[dest] == action.default, (option, their_defaults[dest], action.default)


# ====================================================================================== the refusals
#: name -> (extra Megatron/elastic flags, what the message says, the command line with the fix applied)
REFUSALS = {
    "centre vs --moe-router-topk": (["--elastic-moe-schedule", "6-10"], "does not contain the model's top-2",
                                    ["--elastic-moe-schedule", "1-3"]),
    "--elastic-moe-center vs --moe-router-topk": (["--elastic-moe-center", "8"], "but the model routes to top-2",
                                                  ["--elastic-moe-center", "auto"]),
    "layers vs --num-layers": (["--elastic-moe-layers", "1-3"], "selects layer(s) [2, 3]", ["--elastic-moe-layers", "1"]),
    "schedule past --num-experts": (["--elastic-moe-schedule", "1-5", "--elastic-moe-allow-off-center", "1"],
                                    "only 4 experts", ["--elastic-moe-schedule", "1-3"]),
    "--batch-invariant-mode": (["--batch-invariant-mode"],
                               "--batch-invariant-mode: Megatron's batch-invariant MoE unpermute asserts a fixed "
                               "top-k per token", []),
    "--moe-apply-probs-on-input": (["--moe-apply-probs-on-input"],
                                   "remove --moe-apply-probs-on-input, a store_true flag", []),
    "a CUDA graph of the router": (["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn",
                                    "moe_router", "moe_preprocess"],
                                   "drop 'moe_router', 'moe_preprocess': --cuda-graph-modules attn",
                                   ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn"]),
    "--moe-enable-routing-replay": (["--moe-enable-routing-replay"], "remove --moe-enable-routing-replay", []),
    "sinkhorn": (["--moe-router-load-balancing-type", "sinkhorn"],
                 "--moe-router-load-balancing-type sinkhorn picks experts by its own balancing algorithm",
                 ["--moe-router-load-balancing-type", "aux_loss"]),
    "quantile_balancing": (["--moe-router-load-balancing-type", "quantile_balancing"],
                           "--moe-router-load-balancing-type quantile_balancing picks experts",
                           ["--moe-router-load-balancing-type", "aux_loss"]),
    "inference_optimized": (["--transformer-impl", "inference_optimized"],
                            "--transformer-impl inference_optimized: InferenceTopKRouter",
                            ["--transformer-impl", "local"]),
    "group-limited": (["--moe-router-num-groups", "4", "--moe-router-group-topk", "1"],
                      "group-limited routing keeps 1 of 4 groups (1 experts), fewer than the upper budget 3",
                      ["--moe-router-num-groups", "2", "--moe-router-group-topk", "2"]),
}


def _apply(args: list[str], extra: list[str], fixed: list[str]) -> list[str]:
    """``args`` + ``extra``, with each flag of ``fixed`` set as it says; a flag that ``fixed`` leaves out
    (a store_true flag to remove) removed."""
    result = [*args, *extra]
    flags = [word for word in extra if word.startswith("--")]
    fixed_flags = [word for word in fixed if word.startswith("--")]
    for flag in flags:
        if flag not in fixed_flags:
            result = _without(result, flag, values=0)
    i = 0
    while i < len(fixed):
        flag, values = fixed[i], []
        i += 1
        while i < len(fixed) and not fixed[i].startswith("--"):
            values.append(fixed[i])
            i += 1
        result = _with(result, flag, *values)
    return result


@pytest.mark.parametrize("name", list(REFUSALS))
def test_each_refusal_the_flags_decide_and_its_fix(name):
    extra, says, fixed = REFUSALS[name]
    with pytest.raises((ConfigError, UnsupportedMegatronError), match=None) as caught:
        _check([*MEGATRON_ARGS, *extra])
    assert says in str(caught.value), str(caught.value)
    if isinstance(caught.value, ConfigError):  # its fixes are spelled as flags, and the one applied here
        assert " ".join(fixed) in str(caught.value)
    _check(_apply(MEGATRON_ARGS, extra, fixed))


def test_every_flag_problem_comes_in_one_message():
    with pytest.raises(UnsupportedMegatronError) as caught:
        _check([*MEGATRON_ARGS, "--batch-invariant-mode", "--moe-enable-routing-replay"])
    assert "--batch-invariant-mode" in str(caught.value) and "--moe-enable-routing-replay" in str(caught.value)


def test_router_fusion_is_accepted_with_an_elastic_schedule():
    """Transformer Engine's fused top-k stays on the static layers and in evaluation; the elastic
    layers route unfused in training (tests/mcore/test_mcore_router_fusion.py)."""
    _check([*MEGATRON_ARGS, "--moe-router-fusion", "--elastic-moe-schedule", "1-3"])
    _check([*MEGATRON_ARGS, "--moe-router-fusion", "--elastic-moe-schedule", "1-3", "--elastic-moe-layers", "1"])


@pytest.mark.parametrize("extra", [["--yaml-cfg", "x.yaml"], ["--use-checkpoint-args"],
                                   ["--heterogeneous-layers-config-path", "x.json"]])
def test_command_lines_that_do_not_decide_the_model_are_left_to_model_build(extra):
    args = [*MEGATRON_ARGS, "--elastic-moe-schedule", "6-10", *extra]
    assert megatron_options(args) is None and model_shape(args) is None
    _check(args)  # nothing refused here; the router checks it when it is built


def test_no_num_experts_is_not_decided_either():
    """A script may set num_experts through args_defaults, which fills only what the command line left None."""
    args = _without(MEGATRON_ARGS, "--num-experts")
    assert model_shape(args) is None
    _check([*args, "--elastic-moe-schedule", "6-10"])


def test_the_flags_give_the_model_the_config_is_checked_against():
    assert model_shape(MEGATRON_ARGS) == ModelShape(2, 4, 2, None)
    # a hybrid pattern decides the layers (--num-layers is ignored, as Megatron-LM ignores it)
    assert model_shape([*MEGATRON_ARGS, "--hybrid-layer-pattern", "M*|M*E"]) == ModelShape(2, 4, 5, (4,))
    assert _check(MEGATRON_ARGS).config.resolve(num_experts=4, topk=2).spec() == "1-3"  # the default, from the flags


# ====================================================================================== the entry point
SPY = r"""
import json, os, runpy, sys, time

report = {"exits": [], "init_process_group": 0}
import torch.distributed as dist

class Reached(Exception):
    pass

def spy(*args, **kwargs):
    report["init_process_group"] += 1
    raise Reached("init_process_group reached")

dist.init_process_group = spy
for argv in json.loads(sys.argv[1]):
    if argv[0] == "--control":
        from elastic_moe_plugin import cpu_runtime
        from elastic_moe_plugin.cpu_runtime import megatron_training

        cpu_runtime.disable_torch_compile()
        cpu_runtime.enable(force=True, training=True)
        megatron_training.enable()
        argv = argv[1:]
    sys.argv = ["elastic_moe_plugin.megatron_lm", *argv]
    started = time.monotonic()
    try:
        runpy.run_module("elastic_moe_plugin.megatron_lm", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as error:
        code = error.code
    except Reached:
        code = "reached"
    report["exits"].append({"code": code, "seconds": time.monotonic() - started,
                            "megatron_imported": "megatron" in sys.modules,
                            "process_groups": report["init_process_group"]})
print("SPY " + json.dumps(report))
"""


@pytest.mark.slow  # a subprocess: the entry point, and for the control Megatron-LM's start-up
def test_the_entry_point_refuses_before_any_process_group(tmp_path):
    refusals = ["centre vs --moe-router-topk", "layers vs --num-layers", "--batch-invariant-mode", "quantile_balancing",
                "sinkhorn"]
    commands = [[str(SCRIPT), *MEGATRON_ARGS, *REFUSALS[name][0]] for name in refusals]
    control = _megatron_lm_available()
    if control:
        commands.append(["--control", str(SCRIPT), *MEGATRON_ARGS])
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29577", "OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1", "NO_VCS_VERSION": "1"}
    done = subprocess.run([sys.executable, "-c", SPY, json.dumps(commands)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)
    line = next((line for line in done.stdout.splitlines() if line.startswith("SPY ")), None)
    assert line, done.stdout[-3000:] + done.stderr[-3000:]
    exits = json.loads(line[len("SPY "):])["exits"]
    for name, result in zip(refusals, exits):
        assert result["code"] == 2, (name, result, done.stderr[-3000:])
        assert result["process_groups"] == 0 and not result["megatron_imported"], (name, result)
        assert REFUSALS[name][1] in done.stderr, (name, done.stderr[-3000:])
    assert done.stderr.count("elastic_moe_plugin.megatron_lm: error: ") == len(refusals)
    if control:
        assert exits[-1]["code"] == "reached" and exits[-1]["process_groups"] == 1, (exits[-1], done.stderr[-3000:])


def _megatron_lm_available() -> bool:
    core = importlib.util.find_spec("megatron.core")
    training = importlib.util.find_spec("megatron.training")
    return training is not None and Path(core.origin).parents[1] == Path(training.origin).parents[1]
