"""Python runs this module at the start of every interpreter whose ``PYTHONPATH`` holds this folder
first: it switches on what ``$EMOE_BOOTSTRAP`` names (:mod:`elastic_moe_plugin.tools.child_bootstrap`),
then runs the ``sitecustomize`` it shadows."""

if __name__ == "sitecustomize":  # at interpreter start only, not when a tool walks the package's modules
    from elastic_moe_plugin.tools.child_bootstrap import start

    start(__file__)
