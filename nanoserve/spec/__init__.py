"""Speculative decoding: proposers (n-gram lookup, a draft model), per-row speculation length, and exact acceptance."""
