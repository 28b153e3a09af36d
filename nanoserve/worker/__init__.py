"""The device side: a Worker applies step plans (plan.py) to its model and K/V cache (kv_cache.py,
slot_table.py) through attention (attention.py) and the decode step (decode_step.py), chooses the
sampled rows' tokens (sampling.py), and answers each plan with a StepOutput (worker.py);
build_worker makes one (build.py). Modules are imported where used: plan.py is plain data the
host side imports without building anything."""
