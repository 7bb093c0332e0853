"""Training recipes: the YAML files that reproduce the paper's three settings, and what uses them.

- :mod:`~elastic_moe_plugin.tools.recipes.load`: load, merge and validate a recipe; list them.
- :mod:`~elastic_moe_plugin.tools.recipes.render`: a recipe -> this node's launch command.
- :mod:`~elastic_moe_plugin.tools.recipes.argcheck`: the rendered flags against the frameworks' parsers.
- :mod:`~elastic_moe_plugin.tools.recipes.compute`: parameters, FLOPs and the compute budget C = M·D.
"""
