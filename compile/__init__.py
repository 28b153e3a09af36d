"""The benchmark: `compilebench.py` at the top level chooses a suite, one module each here
(headline, e2e, decode_bench, fidelity_suite, ttft, serve_bench, slotbench, linear_bench), which
writes its CSV (and PNG) under `compile/results/runs/` (ignored by git; the committed reference
figures are in `compile/results/`).

Shared parts: `common` (result paths and names, texts, the decode workload, argument helpers,
timing, table/CSV/PNG writers), `interleave` (systems stepped in turn), `floor` (what a step's
weights alone cost), `llama_peer` (llama.cpp on the same GGUF), `slot_planning` (addressing
against the eager step). It runs from the source tree; the wheel ships `nanoserve` only.
"""
