"""Logits of Hugging Face checkpoints in plain transformers, with elastic_moe_plugin unimportable.

    python _hf_logits.py INPUTS.pt OUT.pt NAME=CHECKPOINT_DIR...

A finder first on ``sys.meta_path`` refuses every ``elastic_moe_plugin`` import (the plugin is absent
as far as this process can tell, whatever ``.pth`` or editable install the environment holds).
Each checkpoint is loaded with ``AutoModelForCausalLM.from_pretrained`` in float32 and run once,
in eval mode without grad, on ``INPUTS.pt``'s ``input_ids``. Saves ``{NAME: logits [B, S, V],
"plugin_modules": [...], "refused": [...]}``: the loaded modules whose name contains
``elastic_moe`` (must be none) and the imports the finder refused.
"""

import importlib.abc
import sys

REFUSED: list[str] = []


class _NoPlugin(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "elastic_moe_plugin" or name.startswith("elastic_moe_plugin."):
            REFUSED.append(name)
            raise ModuleNotFoundError(f"{name} is blocked in this process (plugin absent)", name=name)
        return None


sys.meta_path.insert(0, _NoPlugin())


def main(inputs_path: str, out: str, checkpoints: list[str]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    input_ids = torch.load(inputs_path)["input_ids"]
    result = {}
    for item in checkpoints:
        name, _, directory = item.partition("=")
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        with torch.no_grad():
            result[name] = model(input_ids=input_ids).logits.float().contiguous()
    result["plugin_modules"] = sorted(name for name in sys.modules if "elastic_moe" in name)
    result["refused"] = sorted(set(REFUSED))
    torch.save(result, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
