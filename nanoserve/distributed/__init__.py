"""Tensor parallelism on torch.distributed: sharding (shard.py), the collective edges
(layers.py), and the ranks' launch and step loop (launch.py)."""
