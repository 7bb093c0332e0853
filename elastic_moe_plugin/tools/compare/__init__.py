"""``elastic-moe compare``: a paired, multi-seed static-vs-elastic study with 95% intervals.

Modules, one job each:

- :mod:`.study`: the plan (arms × seeds on the demo's tiny Megatron-core GPT), the runs, and the
  resumable results file;
- :mod:`.stats`: paired differences (elastic − static per seed), the paired-t and the bootstrap
  interval of their mean, Student's t quantile;
- :mod:`.report`: every quantity's comparison, as the results file's rows and the printed table.

The command line is :mod:`elastic_moe_plugin.cli.compare`.
"""
