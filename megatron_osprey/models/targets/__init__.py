"""Target models (dense and MoE) in Megatron-Core, loaded straight from HF safetensors."""
