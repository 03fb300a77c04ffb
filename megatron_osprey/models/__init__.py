"""Megatron-Core models, grouped by model.

- backbone/: the GPT spec builder (Transformer Engine or local), pruning and layer importance;
- drafter/: the Osprey and EAGLE-3 drafters, TTT attention, weight conversion, vocabulary alignment, adaptation;
- target/: the frozen target (its pipeline stage with hidden-state capture, LM head, decoding adapters).
"""
