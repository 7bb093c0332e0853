"""Training recipes: the YAML files that reproduce the paper's three settings (the pretraining one for
Megatron-LM and for torchtitan), and what uses them.

- :mod:`~elastic_moe_plugin.tools.recipes.schema`: the keys a recipe may hold, ``RecipeError``.
- :mod:`~elastic_moe_plugin.tools.recipes.recipe`: a loaded ``Recipe`` and its ``ModelFacts``.
- :mod:`~elastic_moe_plugin.tools.recipes.load`: find, read, merge and list recipes.
- :mod:`~elastic_moe_plugin.tools.recipes.validate`: check a merged recipe.
- :mod:`~elastic_moe_plugin.tools.recipes.topology`: this node's place in the job; world-size fit.
- :mod:`~elastic_moe_plugin.tools.recipes.render`: a recipe -> this node's launch command, and running it
  (:mod:`~elastic_moe_plugin.tools.recipes.render_titan`: the ``torchtitan`` launcher's command).
- :mod:`~elastic_moe_plugin.tools.recipes.titan_models`: the pretraining model as torchtitan's ``--module``.
- :mod:`~elastic_moe_plugin.tools.recipes.argcheck`: the rendered flags against the frameworks' parsers.
- :mod:`~elastic_moe_plugin.tools.recipes.compute`: parameters, FLOPs and the compute budget C = M·D.

The command line is :mod:`elastic_moe_plugin.cli` (``recipes``, ``launch``, ``budget``); docs/recipes.md
describes the format and the settings.
"""
