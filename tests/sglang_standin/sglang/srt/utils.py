"""sglang.srt.utils stand-in: add_prefix."""


def add_prefix(name: str, prefix: str) -> str:
    return name if not prefix else f"{prefix}.{name}"
