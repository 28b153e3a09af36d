"""Speculative decoding: draft proposals, verified against the target model's logits."""
