"""Speculative decoding: proposers guess a row's next tokens cheaply (an n-gram lookup in the
row's own history, or a small draft model), the target model verifies all of them in one
forward, and each row keeps the longest accepted prefix plus one token of its own, so the
output is exactly what plain decoding would have produced. How many tokens a row proposes
adapts to how often its guesses have been accepted lately.
"""
