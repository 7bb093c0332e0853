"""``elastic-moe compare``: a paired, multi-seed static-vs-elastic study with 95% intervals.

Modules, one job each:

- :mod:`.study`: the plan (arms × seeds on the demo's tiny Megatron-core GPT), the runs, and the
  resumable results file;
- :mod:`.stats`: paired differences (elastic − static per seed), the paired-t and the bootstrap
  interval of their mean, Student's t quantile;
- :mod:`.routers`: each seed's elastic routers against its static one (D1, Dk, D1 − Dk, the top-1
  reorder share) through ``elastic-moe diagnose``'s pass;
- :mod:`.evals`: a study read from the recipes' ``elastic-moe eval`` summaries (a cluster's runs);
- :mod:`.report`: every quantity's comparison, as the results file's rows and the printed table;
- :mod:`.plots`: the per-seed differences, the k' sweep with bands, the training curves.

The command line is :mod:`elastic_moe_plugin.cli.compare`.
"""
