"""Subprocess probe of the ms-swift plugin file, for tests/swift/test_swift_plugin.py.

    python tests/swift/_plugin_probe.py hf        RESULT.json   # a `swift sft` process
    python tests/swift/_plugin_probe.py megatron  RESULT.json   # a `megatron sft` process (CPU)

Each mode loads the plugin the way ms-swift does (``swift.utils.import_external_file``, i.e. under
the hashed module name ``_swift_external_<sha256>``) from BOTH plugin paths, the checkout's
``patches/elastic_moe.py`` (a link) and the package's ``elastic_moe_plugin/swift/plugin/elastic_moe.py``, so the plugin
code runs twice in one process, and writes what it observed to RESULT.json.

``megatron`` mode mirrors Megatron-SWIFT's start-up order: ``megatron.core`` and
``swift.megatron`` are imported before the plugin. Megatron-SWIFT itself cannot import on a CPU
machine (``swift.megatron.utils`` imports mcore-bridge, which needs Transformer Engine), so the
probe provides ``swift.megatron.callbacks`` from ms-swift's real ``callbacks/base.py`` plus a
stand-in ``mapping`` module holding an empty ``megatron_callbacks_map``. It then builds a real
2-layer Megatron MoE stack on CPU (``elastic_moe_plugin.cpu_runtime``), runs one training
forward and calls the registered callback's ``on_log`` the way ``BaseMegatronTrainer.on_log`` does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_PATHS = [ROOT / "patches" / "elastic_moe.py", ROOT / "elastic_moe_plugin" / "swift" / "plugin" / "elastic_moe.py"]
MARKER = "__elastic_moe_patched__"


def _marked(function) -> bool:
    return bool(getattr(function, MARKER, False))


def _wrap_depth(function) -> int:
    """How many elastic wrappers sit on top of the stock function (1 = patched exactly once)."""
    depth = 0
    while _marked(function):
        depth += 1
        function = function.__wrapped__
    return depth


def _load_plugins() -> list[str]:
    from swift.utils import import_external_file

    names = []
    for path in PLUGIN_PATHS:
        module = import_external_file(str(path))
        names.append(module.__name__)
    # swift caches by path: a third import of the same path is a no-op; import it again anyway
    import_external_file(str(PLUGIN_PATHS[0]))
    return names


def _hf_state(result: dict) -> None:
    from transformers.models.olmoe import modeling_olmoe
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    from elastic_moe_plugin import hf

    result["hf_applied"] = hf.is_applied()
    result["hf_config"] = repr(hf.active_config())
    result["hf_router_wrap_depth"] = {
        "olmoe": _wrap_depth(modeling_olmoe.OlmoeTopKRouter.__dict__["forward"]),
        "qwen3_moe": _wrap_depth(modeling_qwen3_moe.Qwen3MoeTopKRouter.__dict__["forward"]),
    }


def _callbacks_state(result: dict) -> None:
    from swift.callbacks.mapping import callbacks_map

    from elastic_moe_plugin.swift.callbacks import hf_callback_class

    callback = callbacks_map.get("elastic_moe")
    result["hf_callback"] = None if callback is None else f"{callback.__module__}.{callback.__qualname__}"
    result["hf_callback_is_adapter_class"] = callback is hf_callback_class()
    result["hf_callback_classes_named_elastic"] = sum(
        1 for value in callbacks_map.values() if value.__name__ == "ElasticMoeCallback")


def probe_hf(result: dict) -> None:
    os.environ["ELASTIC_MOE_SCHEDULE"] = "1-3"
    import swift.callbacks  # noqa: F401  (what `swift sft` has imported by the time plugins load)

    result["plugin_modules"] = _load_plugins()
    result["megatron_core_imported"] = "megatron.core" in sys.modules
    result["swift_megatron_imported"] = "swift.megatron" in sys.modules
    package_dir = str((ROOT / "elastic_moe_plugin").resolve())
    result["package_dir_on_sys_path"] = any(
        entry and os.path.realpath(entry) == package_dir for entry in sys.path)
    _hf_state(result)
    _callbacks_state(result)
    _drive_hf_callback(result)


def _drive_hf_callback(result: dict) -> None:
    """The registered callback against a tiny OLMoE, called the way transformers' Trainer calls it."""
    import torch
    from swift.callbacks.mapping import callbacks_map
    from transformers import TrainerControl, TrainerState
    from transformers.models.olmoe import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(0)
    model = OlmoeForCausalLM(OlmoeConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, num_experts=8, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)).train()
    tokens = 256
    model(input_ids=torch.randint(0, 128, (1, tokens)))

    reporter = types.SimpleNamespace(name="reporting callback registered before --callbacks")
    handler = types.SimpleNamespace(callbacks=[reporter])
    trainer = types.SimpleNamespace(callback_handler=handler, model=model)
    callback = callbacks_map["elastic_moe"](types.SimpleNamespace(), trainer)
    handler.callbacks.append(callback)
    state, control = TrainerState(), TrainerControl()
    callback.on_init_end(None, state, control)
    result["hf_callback_runs_first"] = handler.callbacks[0] is callback and len(handler.callbacks) == 2

    state.global_step = 1
    logs = {"loss": 2.0, "learning_rate": 1e-5}
    state.log_history.append({**logs, "step": 1})  # Trainer.log stores a copy before on_log
    callback.on_log(None, state, control, logs=logs, model=model)
    result["hf_logs"] = logs
    result["hf_tokens_per_layer"] = tokens
    result["hf_log_history_has_metrics"] = "elastic_moe/mean_kappa" in state.log_history[-1]
    again = {"loss": 2.0}
    callback.on_log(None, state, control, logs=again, model=model)
    result["hf_second_log_has_kappa_frac"] = any("kappa_frac" in key for key in again)
    untouched = {"eval_loss": 1.0}, {"train_runtime": 3.0, "train_loss": 2.0}
    for other in untouched:
        callback.on_log(None, state, control, logs=other, model=model)
    result["hf_eval_and_summary_log_keys"] = [sorted(other) for other in untouched]


def _stand_in_megatron_callbacks():
    """``swift.megatron.callbacks`` with ms-swift's real MegatronCallback and an empty map."""
    import swift

    swift_dir = Path(swift.__file__).parent
    package = types.ModuleType("swift.megatron")
    package.__path__ = [str(swift_dir / "megatron")]
    callbacks = types.ModuleType("swift.megatron.callbacks")
    callbacks.__path__ = [str(swift_dir / "megatron" / "callbacks")]
    spec = importlib.util.spec_from_file_location("swift.megatron.callbacks.base",
                                                  swift_dir / "megatron" / "callbacks" / "base.py")
    base = importlib.util.module_from_spec(spec)
    mapping = types.ModuleType("swift.megatron.callbacks.mapping")
    mapping.megatron_callbacks_map = {}
    for name, module in (("swift.megatron", package), ("swift.megatron.callbacks", callbacks),
                         ("swift.megatron.callbacks.base", base), ("swift.megatron.callbacks.mapping", mapping)):
        sys.modules[name] = module
    spec.loader.exec_module(base)
    callbacks.MegatronCallback = base.MegatronCallback
    callbacks.megatron_callbacks_map = mapping.megatron_callbacks_map
    callbacks.base, callbacks.mapping = base, mapping
    package.callbacks = callbacks
    return mapping


def _tiny_megatron_stack():
    """Two real Megatron MoE layers (8 experts, top-2, allgather dispatcher), global layers 1 and 2."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, moe_ffn_hidden_size=32,
        num_moe_experts=8, moe_router_topk=2, moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0, use_cpu_initialization=True,
        add_bias_linear=False)
    spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False).submodules.mlp
    torch.manual_seed(0)
    layers = torch.nn.ModuleList()
    for number in (1, 2):
        layer = build_module(spec, config=config) if isinstance(spec, ModuleSpec) else spec(config=config)
        layer.set_layer_number(number)
        layers.append(layer)
    return layers.train()


def probe_megatron(result: dict) -> None:
    os.environ["ELASTIC_MOE_SCHEDULE"] = "1-3"
    from elastic_moe_plugin import cpu_runtime

    cpu_runtime.disable_torch_compile()
    cpu_runtime.enable(force=True)  # megatron-core 0.19 imports a triton-only module
    import megatron.core  # noqa: F401  (Megatron-SWIFT's arguments import it before the plugin)
    import swift.callbacks  # noqa: F401

    mapping = _stand_in_megatron_callbacks()
    result["plugin_modules"] = _load_plugins()

    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.router import TopKRouter

    from elastic_moe_plugin import mcore

    result["megatron_core_version"] = str(mcore.megatron_core_version())
    result["mcore_applied"] = mcore.is_applied()
    result["mcore_config"] = repr(mcore.active_config())
    result["routing_marked"] = _marked(TopKRouter.__dict__["routing"])
    result["routing_wrap_depth"] = _wrap_depth(TopKRouter.__dict__["routing"])
    result["init_wrap_depth"] = _wrap_depth(TopKRouter.__dict__["__init__"])
    preprocess = token_dispatcher.MoEAlltoAllTokenDispatcher.__dict__["preprocess"]
    result["alltoall_preprocess_marked"] = _marked(preprocess)
    result["alltoall_preprocess_wrap_depth"] = _wrap_depth(preprocess)
    _hf_state(result)
    _callbacks_state(result)

    callback_cls = mapping.megatron_callbacks_map.get("elastic_moe")
    result["megatron_callback"] = None if callback_cls is None else callback_cls.__qualname__
    result["megatron_callback_is_megatron_callback"] = (
        callback_cls is not None and issubclass(callback_cls, sys.modules["swift.megatron.callbacks.base"].MegatronCallback))
    if callback_cls is None:
        return

    # One training forward through a real Megatron MoE stack, then the trainer's on_log.
    import torch

    cpu_runtime.initialize_model_parallel()
    try:
        layers = _tiny_megatron_stack()
        tokens = 512
        hidden = torch.randn(tokens, 1, 16)
        for layer in layers:
            hidden = layer(hidden)[0]
        hidden.sum().backward()
        trainer = types.SimpleNamespace(unwrapped_models=[layers], args=types.SimpleNamespace(), state=types.SimpleNamespace())
        callback = callback_cls(trainer)
        import logging

        lines: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        logging.getLogger("elastic_moe_plugin").addHandler(handler)
        callback.on_train_begin()  # BaseMegatronTrainer.train calls it before the first step
        result["megatron_plan_lines"] = [line for line in lines if line.startswith("elastic-moe plan")]
        logs = {"loss": 1.0, "grad_norm": 0.5}
        callback.on_log(logs=logs)
        result["megatron_logs"] = {key: value for key, value in logs.items()}  # the config's default: layer means
        result["megatron_tokens_per_layer"] = tokens
        # the histograms were reset by on_log: an immediate second log has no κ histogram left
        logs_again = {"loss": 1.0}
        callback.on_log(logs=logs_again)
        result["megatron_second_log_has_kappa_frac"] = any("kappa_frac" in key for key in logs_again)
        eval_logs = {"eval_loss": 1.0}
        callback.on_log(logs=eval_logs)
        result["megatron_eval_log_keys"] = sorted(eval_logs)
        # Megatron's per-layer switch on the model's config: a run's callback then logs every layer too
        for layer in layers:
            layer.router.config.moe_per_layer_logging = True
        hidden = torch.randn(tokens, 1, 16)
        for layer in layers:
            hidden = layer(hidden)[0]
        hidden.sum().backward()
        logs = {"loss": 1.0}
        callback_cls(trainer).on_log(logs=logs)
        result["megatron_logs_per_layer"] = dict(logs)
    finally:
        cpu_runtime.destroy()


def main() -> int:
    mode, output = sys.argv[1], Path(sys.argv[2])
    result: dict = {"mode": mode}
    try:
        {"hf": probe_hf, "megatron": probe_megatron}[mode](result)
    except BaseException as error:  # report, and fail the process
        import traceback

        result["error"] = "".join(traceback.format_exception(error))
        output.write_text(json.dumps(result, indent=1, default=str))
        raise
    output.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
