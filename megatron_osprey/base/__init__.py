"""The base layer: atomic file I/O, run-config files and architecture descriptions.

Everything else in the package may import from here; nothing here imports from the
rest of megatron_osprey.
"""
