"""What the training stages read: Megatron indexed text (Stage 2) and conversations or a hidden-state store
(Stage 4). Torch-free: recipes and `osprey plan` read these."""

from __future__ import annotations

import argparse
import dataclasses

from megatron_osprey.config.flags import Flag
from megatron_osprey.models.target.config import TARGET_BACKENDS

DISTILL_MODES = ("online", "offline", "on-policy")
# Draft-OPD's forms (--mode on-policy): "online", the authors' loop (rollout from the current drafter, then an
# update, repeated: training/opd_online.py); "offline", this project's earlier form: one rollout stage, then
# updates on its fixed store (training/on_policy.py).
OPD_FORMS = ("online", "offline")
# The authors' EAGLE-3 script (bingyang-lei/Draft-OPD, verl/examples/on_policy_distillation_trainer/
# run_qwen_eagle3.sh): MAX_NUM_TOKENS 4096 - MAX_PROMPT 512 - 1 new tokens per rollout.
OPD_MAX_NEW_TOKENS = 3583


@dataclasses.dataclass
class IndexedDataConfig:
    """Megatron indexed data: `[weight] prefix` pairs or one prefix, and the split."""

    data_path: list[str] = dataclasses.field(default_factory=list)
    split: str = "969,30,1"
    data_cache_path: str | None = None
    eod_token_id: int | None = None  # None: the model config's eos_token_id


@dataclasses.dataclass
class DistillDataConfig:
    """Conversations JSONL (target-regenerated) through the target's chat template, online; or, offline, the
    hidden-state store the extract stage wrote from them."""

    mode: str = "online"  # online: the frozen target runs in the job; offline: the store
    data_path: list[str] = dataclasses.field(default_factory=list)
    hidden_states: str | None = None  # offline: the extract stage's store
    domain: str | None = None  # the training domain's name, recorded for the train x eval matrix
    enable_thinking: bool | None = None
    shuffle: bool = True
    opd_form: str = "online"  # --mode on-policy only: OPD_FORMS
    # The online form: each round rolls out global batch x opd_round_updates prompts (of --data-path) with the
    # drafter as the last round left it, then takes that many updates on them (the authors: 1 update per round).
    opd_round_updates: int = 1
    opd_max_new_tokens: int = OPD_MAX_NEW_TOKENS
    opd_limit: int | None = None  # the online form's prompts: the first N of --data-path (None: all)
    # The online form's rollout target: "hf", the HF model whole on each rank (its KV cache); "megatron", the
    # Megatron-Core target sharded as the job's layout says (TP, and EP for MoE targets), for targets that need it.
    opd_target_backend: str = "hf"

    def rolls_out_online(self) -> bool:
        """Draft-OPD's online loop (--mode on-policy --opd-form online): the job rolls out its own data."""
        return self.mode == "on-policy" and self.opd_form == "online"

    # DOMAIN=FILE held-out conversations whose TTT loss is logged at every --eval-interval (loss/valid/DOMAIN), as
    # the release's --eval-data (scripts/osprey/run_adaptation.py); online mode: the target runs on them in the job.
    eval_data: list[str] = dataclasses.field(default_factory=list)

    def held_out_sets(self) -> dict[str, str]:
        """{domain: file} from --eval-data DOMAIN=FILE; one clear error for a malformed or repeated domain."""
        sets: dict[str, str] = {}
        for spec in self.eval_data:
            domain, sep, path = str(spec).partition("=")
            if not sep or not domain or not path or "/" in domain or domain in sets:
                raise ValueError(
                    f"--eval-data {spec!r} must be DOMAIN=FILE, one per domain (e.g. --eval-data code=eval/code.jsonl)."
                )
            sets[domain] = path
        return sets


INDEXED_DATA_FLAGS = [
    Flag("--data-path", "data_path", {"nargs": "+", "help": "PREFIX, or WEIGHT PREFIX [WEIGHT PREFIX ...]"}),
    Flag("--split", "split", {"help": "train,valid,test weights, e.g. 969,30,1"}),
    Flag("--data-cache-path", "data_cache_path", {}),
    Flag("--eod-token-id", "eod_token_id", {"type": int}),
]
DISTILL_DATA_FLAGS = [
    Flag("--mode", "mode", {"choices": list(DISTILL_MODES)}),
    Flag("--data-path", "data_path", {"nargs": "+", "help": "conversations JSONL file(s)"}),
    Flag(
        "--hidden-states",
        "hidden_states",
        {"help": "offline: the store the extract stage wrote; on-policy: the rollout stage's store"},
    ),
    Flag("--domain", "domain", {"help": "name of the training domain (eval's train x eval matrix)"}),
    Flag("--enable-thinking", "enable_thinking", {"action": "store_true", "default": argparse.SUPPRESS}),
    Flag("--no-shuffle", "shuffle", {"action": "store_false"}),
    Flag(
        "--opd-form",
        "opd_form",
        {
            "choices": list(OPD_FORMS),
            "help": "--mode on-policy: online (the Draft-OPD authors' loop over --data-path prompts, default) or "
            "offline (one rollout store, --hidden-states)",
        },
    ),
    Flag(
        "--opd-round-updates",
        "opd_round_updates",
        {"type": int, "help": "online Draft-OPD: updates per rollout round (1, the authors')"},
    ),
    Flag("--opd-limit", "opd_limit", {"type": int, "help": "online Draft-OPD: the first N prompts only"}),
    Flag(
        "--opd-max-new-tokens",
        "opd_max_new_tokens",
        {"type": int, "help": f"online Draft-OPD: new tokens per rollout ({OPD_MAX_NEW_TOKENS}, the authors')"},
    ),
    Flag(
        "--opd-target-backend",
        "opd_target_backend",
        {
            "choices": list(TARGET_BACKENDS),
            "help": "online Draft-OPD: roll out with the HF target whole on each rank (hf, default) or the "
            "Megatron-Core target at the job's TP/EP layout (megatron)",
        },
    ),
    Flag(
        "--eval-data",
        "eval_data",
        {
            "action": "append",
            "metavar": "DOMAIN=FILE",
            "help": "held-out conversations whose TTT loss is logged as loss/valid/DOMAIN at every --eval-interval "
            "(online mode; repeatable)",
        },
    ),
]
