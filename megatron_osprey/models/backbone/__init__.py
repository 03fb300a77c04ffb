"""The GPT backbone: its Megatron-Core spec builder, pruning to the first N layers, layer importance."""
