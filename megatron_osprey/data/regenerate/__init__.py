"""Regenerate conversations with the target model (server pool or in-process HF model)."""

from megatron_osprey.data.regenerate.backends import (
    BackendRequestError,
    ChatBackend,
    HFBackend,
    HFBackendConfig,
    SamplingParams,
    ServerBackend,
    ServerBackendConfig,
)
from megatron_osprey.data.regenerate.runner import (
    RegenerateSummary,
    RegenerationRun,
    failures_path_for,
    regenerate_conversation,
    regenerate_file,
)

__all__ = [
    "BackendRequestError",
    "ChatBackend",
    "HFBackend",
    "HFBackendConfig",
    "RegenerationRun",
    "RegenerateSummary",
    "SamplingParams",
    "ServerBackend",
    "ServerBackendConfig",
    "failures_path_for",
    "regenerate_conversation",
    "regenerate_file",
]
