"""Packed weights: group-wise codes, GGUF blocks read as codes, the packed linear layers,
the weight plan that installs them, and the CPU kernels (C++ tiers in kernels/)."""
