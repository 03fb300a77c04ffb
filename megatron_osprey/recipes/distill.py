"""Stage 3 + 4 recipes: one chain per target x method x hardware, from the pretrained backbone to the exported drafter.

Chains (`osprey pipeline` runs them in order; each stage reads what the one before it wrote):
    Osprey:  adapt -> regenerate -> distill -> export -> evaluate   (adapt reads paths.backbone: a pretrain run's
             output directory, RUN/pretrain of a backbone recipe)
    EAGLE-3: regenerate -> distill -> export -> evaluate             (from scratch, the target's frozen embedding)

Budgets, from the paper and its release (LeanModels/Osprey; `osprey plan` prints each recipe's schedule). Updates per
epoch are the release's: examples // global batch (its data loader drops a last partial batch).
- Qwen3-8B: 3 epochs over 65,000 regenerated examples per domain at global batch 2 (one 4,096-token sequence per GPU on
  2 GPUs): 97,500 updates at lr 1e-4, 4% warmup, clip 1.0 (the paper; scripts/osprey/run_adaptation.py).
- Llama-3.3-70B: the release's examples/llama33-70b/train.sh: 8 GPUs, global batch 8, a 100,000-sample split x 3
  epochs = 37,500 updates at lr 1e-4, the target at TP 4 in the same job. Here the drafter shares the target's TP
  group (DP 2), so the global batch of 8 is 4 micro-batches per DP rank; batch and updates are the release's.
- MiniMax-M2.5: the release's examples/minimax-m25/train.sh and README.md: 4 GPUs (one 4 x B200 node), global batch 4
  (one sample per GPU), the 70,897-sample code split (its README's count), lr 1e-4 with the 4% warmup of
  scripts/osprey/run_adaptation.py; a cosine schedule over 3 epochs = 3 x 17,724 = 53,172 updates, stopped at
  MAX_NUM_STEPS = 35,000 (its epoch_1_step_35000 checkpoint), so the run ends at the cosine's value there, about 28% of
  the peak lr. Here that is --lr-decay-iters 53172 with --train-iters 35000. The target is the FP8 checkpoint at TP 4 /
  EP 4 as the release serves it; its training forward here runs the FP8 weights dequantized to BF16 (no FP8 target
  forward exists), which fits 4 x B200 and not 4 x H100 (the release's README: its adaptation does not fit H100 either),
  so the H100 recipe keeps 8 GPUs at TP 8 / EP 8 with the release's batch and schedule. The evaluation is the release's
  examples/minimax-m25/eval.sh suites (MINIMAX_EVAL_SUITES, built by `osprey suite`; `osprey plan` lists the commands),
  served at TP 4 / EP 4 with --trust-remote-code and --disable-custom-all-reduce.

Regeneration follows the release's scripts/osprey/regenerate_data.sh: temperature 1.0, 4,096 new tokens, SGLang's
reasoning parser (qwen3; minimax-append-think for MiniMax-M2.5), a context of 2 x 4,096 + 2,048, 32 requests in flight
per server, --trust-remote-code on every server. Greedy is the named option `--set regenerate.sampling.temperature=0`.
The frozen target runs in BF16 (no FP8 target forward exists), so the recipes are BF16 only; the drafter's GEMMs are
BF16 too.
"""

from __future__ import annotations

import copy
import dataclasses
import math

from megatron_osprey.data.config import OPD_FORMS, DistillDataConfig
from megatron_osprey.data.regenerate.backends import SamplingParams
from megatron_osprey.data.user_data import UserDataConfig
from megatron_osprey.losses.config import TTTLossConfig
from megatron_osprey.models.drafter.config import DistillDrafterConfig
from megatron_osprey.models.target.config import TargetConfig
from megatron_osprey.parallel.config import ParallelConfig
from megatron_osprey.recipes.recipe import Recipe, Resources, ServerPool, whole_node_mem
from megatron_osprey.stages.adapt import AdaptConfig
from megatron_osprey.stages.distill import DistillConfig
from megatron_osprey.stages.evaluate import EvaluateConfig
from megatron_osprey.stages.export import ExportConfig
from megatron_osprey.stages.regenerate import RegenerateConfig
from megatron_osprey.training.config import CheckpointConfig, LoggingConfig, TrainingConfig

EPOCHS = 3
REGENERATE_MAX_TOKENS = 4096
# The paper's 5 train/eval domains, plus this project's extra eval domains.
PAPER_DOMAINS = ("chat", "code", "commonsense", "finance", "math")
EXTRA_EVAL_DOMAINS = ("science", "multilingual")
# EAGLE-3's layer for a mixture-of-experts target is dense; MiniMax-M2 configs name this width mlp_intermediate_size.
# gpt-oss: SpecForge's configs/gpt-oss-20B-eagle3.json (hidden 2880, as the 120B's).
EAGLE3_DENSE_FFN = {"minimax_m25": 8192, "deepseek_v3": 18432, "kimi_k2": 18432, "gpt_oss_120b": 17280}


# The release's regenerate_data.sh: CONCURRENCY=32 requests in flight per server (this project had 64 in all).
REGENERATE_CONCURRENCY_PER_SERVER = 32


@dataclasses.dataclass(frozen=True)
class TargetLayout:
    """How one target runs on one GPU type: GPUs per node (and nodes), target TP/EP, the server pool, the budget."""

    gpus: int  # per node
    tp: int
    ep: int
    server_tp: int
    examples: int
    global_batch: int
    budget: str
    reasoning_parser: str | None
    domain: str = "chat"
    stop_step: int | None = None  # the release stops before its schedule's end (MiniMax-M2.5: 35,000 of 53,172)
    server_ep: int = 1  # the eval server's --ep-size
    fp8_target_serving: bool = False  # the eval server's --disable-custom-all-reduce (the release's FP8 MoE serving)
    nodes: int = 1  # > 1: the distillation job spans nodes (expert parallelism across them)

    @property
    def schedule_steps(self) -> int:
        """The learning-rate schedule's length: EPOCHS x (examples // global batch), the release's updates."""
        return EPOCHS * (self.examples // self.global_batch)

    @property
    def train_iters(self) -> int:
        return self.stop_step or self.schedule_steps


_QWEN3_8B = dict(
    examples=65_000,
    global_batch=2,
    budget="the paper: 3 epochs x 65,000 examples / global batch 2 = 97,500 updates",
    reasoning_parser="qwen3",
)
_LLAMA = dict(
    examples=100_000,
    global_batch=8,
    budget="the release (examples/llama33-70b/train.sh): 3 epochs x 100,000 samples / global batch 8 = 37,500 updates",
    reasoning_parser=None,
    domain="perfectblend",
)
# examples/llama33-70b/README.md: PerfectBlend records numbered in file order, random.seed(42), random.shuffle, the
# first 100,000 train and the next 512 eval (multi-turn conversations kept as they are).
PERFECTBLEND_RULE = dict(split_rule="shuffle", seed=42, max_train=100_000, eval_size=512, prompt_turns="all")
# examples/minimax-m25/train.sh: NUM_GPUS 4, MAX_NUM_STEPS 35000; README.md: 70,897 samples, 17,724 steps an epoch.
MINIMAX_EXAMPLES, MINIMAX_GLOBAL_BATCH, MINIMAX_STOP_STEP = 70_897, 4, 35_000
_MINIMAX = dict(
    examples=MINIMAX_EXAMPLES,
    global_batch=MINIMAX_GLOBAL_BATCH,
    budget="the release (examples/minimax-m25/train.sh): a cosine over 3 epochs x 70,897 samples / global batch 4 = "
    "53,172 updates, stopped at step 35,000",
    reasoning_parser="minimax-append-think",
    domain="code",
    stop_step=MINIMAX_STOP_STEP,
    server_ep=4,
    fp8_target_serving=True,
)
# DeepSeek-V3 / Kimi-K2: neither the paper nor the release trains a drafter for them; the 70B release's budget.
_DEEPSEEK = dict(
    examples=100_000,
    global_batch=8,
    budget="this project's choice (the paper and the release train none for this target): the Llama-3.3-70B "
    "release's 3 epochs x 100,000 samples / global batch 8 = 37,500 updates",
    reasoning_parser=None,
)
_GPT_OSS = dict(
    examples=70_000,
    global_batch=8,
    budget="this project's choice (no Osprey run on gpt-oss is published): MiniMax-M2.5's 70,000 prompts, 3 epochs "
    "at global batch 8",
    reasoning_parser="gpt-oss",
)
LAYOUTS = {
    ("qwen3_8b", "h100"): TargetLayout(2, 1, 1, 1, **_QWEN3_8B),
    ("qwen3_8b", "b200"): TargetLayout(2, 1, 1, 1, **_QWEN3_8B),
    ("llama33_70b", "h100"): TargetLayout(8, 4, 1, 4, **_LLAMA),
    ("llama33_70b", "b200"): TargetLayout(8, 4, 1, 4, **_LLAMA),
    # The release's layout on B200: 4 GPUs, target TP 4 / EP 4. The BF16-dequantized target does not fit 4 H100s
    # (`osprey plan` shows it), so on H100 8 GPUs at TP 8 / EP 8; the FP8 eval server is the release's TP 4 / EP 4.
    ("minimax_m25", "h100"): TargetLayout(8, 8, 8, 4, **_MINIMAX),
    ("minimax_m25", "b200"): TargetLayout(4, 4, 4, 4, **_MINIMAX),
    # DeepSeek-V3 in BF16 (dequantized from its FP8 checkpoint at load): one node of B200 at TP 8 / EP 8; on H100 the
    # experts need 4 nodes (EP 32). Kimi-K2 is the same architecture: its config at paths.target plans its own size.
    ("deepseek_v3", "h100"): TargetLayout(8, 8, 32, 8, **_DEEPSEEK, nodes=4),
    ("deepseek_v3", "b200"): TargetLayout(8, 8, 8, 8, **_DEEPSEEK),
    # gpt-oss-120B dequantized from MXFP4 to BF16 (~117B parameters): TP 8 / EP 8 over one node of either GPU.
    ("gpt_oss_120b", "h100"): TargetLayout(8, 8, 8, 8, **_GPT_OSS),
    ("gpt_oss_120b", "b200"): TargetLayout(8, 8, 8, 8, **_GPT_OSS),
}

# examples/minimax-m25/eval.sh: the public suite (humaneval, math500, livecodebench, mtbench, commonsense_eval at 64
# prompts each) and the multilingual one (mgsm 64, global_mmlu 84, global_mmlu_native 84). Eval set -> prompts; each
# is an `osprey suite` eval set of exactly that many prompts (the first ones, as the release's benchmark takes).
MINIMAX_EVAL_SUITES = {
    "humaneval": 64,
    "math500": 64,
    "livecodebench": 64,
    "mtbench": 64,
    "commonsense": 64,
    "mgsm": 64,
    "global_mmlu": 84,
    "global_mmlu_native": 84,
}


def adaptation_steps(examples: int, global_batch: int, epochs: int = EPOCHS) -> int:
    """Updates for `epochs` passes over `examples` at `global_batch` sequences per update."""
    return math.ceil(epochs * examples / global_batch)


def target_recipe(target: str, method: str, hardware: str, domain: str | None, eagle3_layers: int = 1) -> Recipe:
    """The chain that trains one drafter for `target` on `domain` with `method` (osprey or eagle3)."""
    lay = LAYOUTS[(target, hardware)]
    domain = domain or lay.domain
    eagle3 = method == "eagle3"
    parallel = ParallelConfig(
        tensor_model_parallel_size=lay.tp,
        expert_model_parallel_size=lay.ep,
        # Experts are spread by EP alone: TP x EP would need more GPUs than the node has.
        expert_tensor_parallel_size=1 if lay.ep > 1 else None,
        sequence_parallel=lay.ep > 1,  # MoE with TP needs sequence parallelism in Megatron-Core
    )
    distill = DistillConfig(
        drafter=DistillDrafterConfig(
            baseline="eagle3" if eagle3 else None,
            eagle3_num_layers=eagle3_layers,
            transformer_impl="transformer_engine",
            bf16=True,
        ),
        target=TargetConfig(),
        data=DistillDataConfig(mode="online"),
        ttt=TTTLossConfig(),
        parallel=parallel,
        training=TrainingConfig(
            micro_batch_size=1, global_batch_size=lay.global_batch, seq_length=4096, train_iters=lay.train_iters
        ),
        checkpoint=CheckpointConfig(save_interval=1000),
        logging=LoggingConfig(wandb_project="osprey"),
    )
    if lay.stop_step is not None:
        # The cosine spans the whole schedule and the run stops inside it; the release's warmup is
        # int(0.04 x total steps) (SpecForge's BF16Optimizer), of the schedule, not of the shorter run.
        distill.optimizer.lr_decay_iters = lay.schedule_steps
        distill.optimizer.lr_warmup_iters = int(distill.optimizer.lr_warmup_fraction * lay.schedule_steps)
    sampling = SamplingParams(temperature=1.0, max_tokens=REGENERATE_MAX_TOKENS)
    recipe = Recipe(
        name="",
        hardware=hardware,
        precision="bf16",
        chain=("regenerate", "distill", "export", "evaluate") if eagle3 else PIPELINE_OSPREY,
        target=target,
        source="qwen3_4b",
        domain=domain,
        eval_domains=list(PAPER_DOMAINS),
        budget=lay.budget,
        servers=ServerPool(
            servers=8 // lay.server_tp,
            tensor_parallel_size=lay.server_tp,
            reasoning_parser=lay.reasoning_parser,
            context_length=2 * REGENERATE_MAX_TOKENS + 2048,
            # The release passes --trust-remote-code to every regeneration server (scripts/osprey/regenerate_data.sh)
            # and to its MiniMax eval server (examples/minimax-m25/eval.sh), not to the Qwen3 / Llama eval servers.
            trust_remote_code=True,
            eval_trust_remote_code=lay.fp8_target_serving,
            expert_parallel_size=lay.server_ep,
            disable_custom_all_reduce=lay.fp8_target_serving,
        ),
        resources={
            "adapt": Resources(cpus_per_task=16, time="01:00:00"),
            # The server pool fills whole nodes; each server's srun step asks for its share of this memory, else on a
            # cluster that schedules memory the first step takes all of it and the others wait (launcher/render.py).
            "regenerate": Resources(gpus_per_node=8, time="24:00:00", mem=whole_node_mem(hardware)),
            "distill": Resources(nodes=lay.nodes, gpus_per_node=lay.gpus, time="48:00:00"),
            "export": Resources(cpus_per_task=8, time="00:30:00"),
            "evaluate": Resources(gpus_per_node=max(lay.server_tp, 1), time="08:00:00"),
        },
        # No aux layer ids: they come from the target's config.json by EAGLE-3's rule (1, L/2-1, L-4), for
        # MiniMax-M2.5's 62 layers the paper's [1, 30, 58]; a target swapped in with paths.target gets its own.
        adapt=None if eagle3 else AdaptConfig(),
        regenerate=RegenerateConfig(
            backend="server", sampling=sampling, concurrency=REGENERATE_CONCURRENCY_PER_SERVER * (8 // lay.server_tp)
        ),
        distill=distill,
        export=ExportConfig(format="sglang"),
        evaluate=EvaluateConfig(),
    )
    _release_inputs(recipe, target)
    return recipe


def _release_inputs(recipe: Recipe, target: str) -> None:
    """The release's inputs: Llama-3.3-70B's PerfectBlend split rule, MiniMax-M2.5's benchmark eval sets."""
    if target == "llama33_70b":
        recipe.data = UserDataConfig(**PERFECTBLEND_RULE)
    if target == "minimax_m25":
        recipe.eval_domains = list(MINIMAX_EVAL_SUITES)
        recipe.eval_suites = dict(MINIMAX_EVAL_SUITES)
        recipe.paths.eval_data = "{root}/data/suites/{domain}.jsonl"


PIPELINE_OSPREY = ("adapt", "regenerate", "distill", "export", "evaluate")
PIPELINE_OPD = ("rollout", "distill", "export", "evaluate")  # the offline form: one rollout stage, then updates
PIPELINE_OPD_ONLINE = ("distill", "export", "evaluate")  # the online form rolls out inside the distill job

# Draft-OPD as its authors run it on EAGLE-3 (bingyang-lei/Draft-OPD,
# verl/examples/on_policy_distillation_trainer/run_qwen_eagle3.sh; the loop is verl/verl/trainer/ppo/ray_trainer.py's
# fit(), training/opd_online.py): ROLLOUT_TEMPERATURE=0.0, LR=1e-4 with lr_warmup_steps_ratio=0.015 and a cosine,
# EAGLE3_TTT_LENGTH=7 (also the rollout's speculative_num_steps), train_epochs=8, one update per
# UPDATE_ACCUMULATION_STEPS x TRAIN_PROMPT_BSZ = 10 x 24 rollouts, the target's full distribution
# (eagle3_native_target_distribution), rejected_draft_stream_weight=0.0, MAX_NUM_TOKENS 4096 - MAX_PROMPT 512 - 1
# new tokens. Their prompt pool is their own data set; here the prompts are the first tenth of the SFT recipe's
# regenerated conversations (OPD_PROMPT_SHARE, this project's choice).
OPD_ONLINE_LR, OPD_ONLINE_WARMUP, OPD_ONLINE_TTT, OPD_ONLINE_EPOCHS = 1e-4, 0.015, 7, 8
OPD_ONLINE_BATCH = 10 * 24

# The offline form, this project's earlier one (`--opd-form offline`, the *_opd_offline_* recipes): neither the
# paper nor the release fixes it; the demo's earlier osprey_opd rule at scale: rollouts on a tenth of the SFT
# examples (the first ones of the regenerated data), chains of 5 drafts (the TTT depth), sampled at the
# regeneration's temperature 1.0 up to its 4,096 new tokens; then 2 epochs over them at a tenth of the SFT lr.
OPD_PROMPT_SHARE, OPD_EPOCHS, OPD_LR_SHARE, OPD_STEPS = 10, 2, 10, 5


def opd_target_backend(target: str, hardware: str) -> str:
    """The online form's rollout target: the HF model and its KV cache, whole on each GPU, where it fits one GPU
    (target TP 1); else the Megatron-Core target at the distillation's TP/EP layout (exact recompute per verify)."""
    return "hf" if LAYOUTS[(target, hardware)].tp == 1 else "megatron"


def opd_recipe(target: str, hardware: str, domain: str | None, form: str = "online") -> Recipe:
    """Osprey + Draft-OPD for `target` from the SFT drafter (paths.sft, by default the Osprey recipe's run under
    the same root) on its regenerated prompts: the authors' online loop (form "online", the default), or the
    offline form's rollout stage then updates on its store; export, evaluate."""
    lay = LAYOUTS[(target, hardware)]
    if form not in OPD_FORMS:
        raise ValueError(f"Draft-OPD form {form!r}: expected one of {OPD_FORMS}.")
    recipe = target_recipe(target, "osprey", hardware, domain)
    sft_run = f"{{root}}/{target}_osprey_distill_{lay.gpus * lay.nodes}gpu_{hardware}_bf16_{{domain}}"
    recipe.paths.sft = f"{sft_run}/distill"
    recipe.paths.conversations = f"{sft_run}/regenerate/conversations.jsonl"
    prompts = lay.examples // OPD_PROMPT_SHARE
    if form == "online":
        return _opd_online(recipe, lay, prompts, opd_target_backend(target, hardware))
    return _opd_offline(recipe, lay, prompts)


def _opd_online(recipe: Recipe, lay: TargetLayout, prompts: int, backend: str) -> Recipe:
    """The authors' loop inside one distill job: rollout of 240 prompts, one update, repeated for 8 epochs."""
    from megatron_osprey.data.config import OPD_MAX_NEW_TOKENS

    sft = recipe.distill
    sft.data = DistillDataConfig(
        mode="on-policy",
        opd_form="online",
        opd_max_new_tokens=OPD_MAX_NEW_TOKENS,
        opd_limit=prompts,
        opd_target_backend=backend,
    )
    sft.ttt.ttt_steps = OPD_ONLINE_TTT
    sft.training.global_batch_size = OPD_ONLINE_BATCH
    sft.training.train_iters = adaptation_steps(prompts, OPD_ONLINE_BATCH, OPD_ONLINE_EPOCHS)
    sft.optimizer.lr, sft.optimizer.min_lr = OPD_ONLINE_LR, 0.0
    sft.optimizer.lr_warmup_fraction, sft.optimizer.lr_decay_style = OPD_ONLINE_WARMUP, "cosine"
    sft.checkpoint.save_interval = 50
    recipe.chain, recipe.adapt, recipe.regenerate = PIPELINE_OPD_ONLINE, None, None
    where = (
        "the HF target whole on each GPU"
        if backend == "hf"
        else f"the Megatron-Core target at TP {lay.tp}" + (f" / EP {lay.ep}" if lay.ep > 1 else "")
    )
    recipe.budget = (
        f"the Draft-OPD authors' loop (run_qwen_eagle3.sh): greedy rollouts of the current drafter (chains of "
        f"{OPD_ONLINE_TTT}, {where}), one update per {OPD_ONLINE_BATCH} rollouts, {OPD_ONLINE_EPOCHS} epochs over "
        f"the first {prompts:,} prompts (a tenth of {lay.examples:,}: this project's choice) = "
        f"{sft.training.train_iters:,} updates at lr {OPD_ONLINE_LR:g}, {OPD_ONLINE_WARMUP:.1%} warmup, cosine, "
        f"TTT {OPD_ONLINE_TTT}"
    )
    return recipe


def _opd_offline(recipe: Recipe, lay: TargetLayout, prompts: int) -> Recipe:
    """This project's earlier form: one rollout stage, then 2 epochs on its store at a tenth of the SFT lr."""
    from megatron_osprey.stages.rollout import RolloutConfig

    sft = recipe.distill
    # A dense target that fits one GPU rolls out with the HF model and its KV cache, one replica per GPU; the others
    # on the Megatron-Core target at the distillation's layout, which recomputes each sequence at every verify.
    hf = lay.tp == 1
    recipe.rollout = RolloutConfig(
        steps=OPD_STEPS,
        top_k=32,
        max_new_tokens=REGENERATE_MAX_TOKENS,
        limit=prompts,
        dtype="bfloat16",
        temperature=1.0,
        target_backend="hf" if hf else "megatron",
        parallel=copy.deepcopy(sft.parallel) if not hf else ParallelConfig(),
    )
    sft.data = DistillDataConfig(mode="on-policy", opd_form="offline")
    sft.ttt.ttt_steps = OPD_STEPS
    sft.training.train_iters = adaptation_steps(prompts, lay.global_batch, OPD_EPOCHS)
    # Its own schedule over its own run, not the SFT's cosine stopped early (MiniMax-M2.5's).
    sft.optimizer.lr_decay_iters, sft.optimizer.lr_warmup_iters = None, 0
    sft.optimizer.lr /= OPD_LR_SHARE
    sft.checkpoint.save_interval = 500
    recipe.chain, recipe.adapt, recipe.regenerate = PIPELINE_OPD, None, None
    recipe.budget = (
        f"this project's offline form (--opd-form offline; not the authors'): rollouts on {prompts:,} prompts "
        f"(a tenth of {lay.examples:,}), {OPD_EPOCHS} epochs at global batch {lay.global_batch} = "
        f"{sft.training.train_iters:,} updates at a tenth of the SFT lr"
    )
    recipe.resources["rollout"] = Resources(nodes=lay.nodes, gpus_per_node=lay.gpus, time="48:00:00")
    return recipe
