"""The benchmark's parts: one module per suite (workloads, arms, timing, report writers).

`compilebench.py` at the top level chooses the suite; recorded runs live in `compile/results/`.
"""
