"""engram-sweep: does Engram beat the same parameters spent on routed experts?

From a base MoE preset and a total-parameter budget, `variants` derives matched models (pure
MoE; Engram taking a share rho of the routed-expert parameters; two controls), `runner` trains
each through the normal trainer CLI on the same tokens for several seeds, and `report` writes
one JSON and the figures. `cli` is the command line (docs/allocation-sweep.md).
"""
