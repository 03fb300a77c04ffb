"""Reference speculative decoding (chain and EAGLE-2 tree; greedy and lossless sampling)."""

from megatron_osprey.models.target.decoding import HFTargetModel, TargetModel

from .config import SpecConfig, SpecResult, acceptance_summary
from .draft_session import DraftSession, ReferenceDraftSession
from .generate import speculative_generate, target_generate
from .tree import DraftTree, build_chain, build_draft, build_tree
from .verify import accept_greedy, accept_sampling

__all__ = [
    "DraftSession",
    "DraftTree",
    "HFTargetModel",
    "ReferenceDraftSession",
    "SpecConfig",
    "SpecResult",
    "TargetModel",
    "acceptance_summary",
    "accept_greedy",
    "accept_sampling",
    "build_chain",
    "build_draft",
    "build_tree",
    "speculative_generate",
    "target_generate",
]
