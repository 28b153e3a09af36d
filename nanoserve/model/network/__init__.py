"""The network: its configuration and per-architecture records, the Llama family and its
experts, the reference attention and the dense oracle, random models, fidelity metrics."""
