"""The serving formats a drafter exports to (torch-free: the export stage's flags and recipes read it)."""

FORMATS = ("sglang", "hf", "speculators")
