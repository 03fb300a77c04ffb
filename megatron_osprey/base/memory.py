"""Memory arithmetic, torch-free (planning runs on login nodes without torch).

The frozen target: per-GPU memory for prefill under a TP / PP / EP layout, before loading it.

Weights: each rank holds 1/TP of attention and dense MLP, 1/EP of the experts
(each 1/ETP), the replicated norms and router, and on the first / last pipeline
stage the embedding / LM head (1/TP of the padded vocabulary). Activations: one
prefill micro-batch without gradients, no KV cache kept; the peak is the widest
intermediate of one layer plus the residual stream and the captured hidden states.
"""

from __future__ import annotations

import dataclasses
import math

from megatron_osprey.base.arch import ModelArch

GIB = 1 << 30
# CUDA context, NCCL buffers and allocator fragmentation, measured as a flat
# reserve rather than modelled.
RUNTIME_RESERVE_BYTES = 3 * GIB


class TargetMemoryError(ValueError):
    """The requested layout does not fit the GPU memory it was given."""


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one GPU needs to hold its share of the target and run one prefill micro-batch."""

    weight_bytes: int
    activation_bytes: int
    reserve_bytes: int
    layout: str

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes + self.reserve_bytes

    def summary(self) -> str:
        """One line with the figures in GiB."""
        return (
            f"per-GPU memory estimate for {self.layout}: weights {self.weight_bytes / GIB:.2f} GiB + "
            f"prefill activations {self.activation_bytes / GIB:.2f} GiB + runtime reserve "
            f"{self.reserve_bytes / GIB:.2f} GiB = {self.total_bytes / GIB:.2f} GiB"
        )


def _stage_weight_params(arch: ModelArch, tp: int, pp: int, ep: int, etp: int, stage: int) -> int:
    if arch.mla is not None:  # multi-latent attention, dense and MoE layers mixed (DeepSeek-V3, Kimi-K2)
        from megatron_osprey.base import deepseek_v3

        return _with_embeddings(arch, tp, pp, stage, deepseek_v3.stage_layer_params(arch, tp, pp, ep, etp, stage))
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    attn = (h * (q + 2 * kv) + q * h) // tp + ((q + 2 * kv) // tp if arch.qkv_bias else 0)
    if arch.qk_norm_over_projection:
        attn += (q + kv) // tp
    elif arch.qk_layernorm:
        attn += 2 * d
    if arch.is_moe:
        experts = math.ceil(arch.num_experts / ep)
        mlp = experts * 3 * h * arch.moe_ffn_hidden_size // etp + arch.num_experts * h
    else:
        mlp = 3 * h * arch.ffn_hidden_size // tp
    layer = attn + mlp + 2 * h
    return _with_embeddings(arch, tp, pp, stage, math.ceil(arch.num_layers / pp) * layer)


def _with_embeddings(arch: ModelArch, tp: int, pp: int, stage: int, params: int) -> int:
    """`params` plus the embedding (first stage), final norm and LM head (last stage) shards."""
    h = arch.hidden_size
    vocab_shard = arch.padded_vocab_size(tp) // tp * h
    if stage == 0:
        params += vocab_shard
    if stage == pp - 1:
        params += h
        if pp > 1 or not arch.tie_word_embeddings:
            params += vocab_shard
    return params


def parallel_sizes(parallel) -> dict[str, int | None]:
    """estimate_target_memory's parallel keywords from a ParallelConfig (or anything with its four sizes)."""
    return {
        "tensor_parallel": parallel.tensor_model_parallel_size,
        "pipeline_parallel": parallel.pipeline_model_parallel_size,
        "expert_parallel": parallel.expert_model_parallel_size,
        "expert_tensor_parallel": parallel.expert_tensor_parallel_size,
    }


def estimate_target_memory(
    arch: ModelArch,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
    micro_batch_size: int = 1,
    seq_length: int = 4096,
    num_captured_layers: int = 4,
    bytes_per_param: int = 2,
    bytes_per_activation: int = 2,
    flash_attention: bool = True,
    reserve_bytes: int = RUNTIME_RESERVE_BYTES,
) -> MemoryEstimate:
    """Estimate the busiest rank's bytes (max over pipeline stages) for prefill extraction."""
    tp, pp, ep = tensor_parallel, pipeline_parallel, expert_parallel
    etp = expert_tensor_parallel or tp
    weights = max(_stage_weight_params(arch, tp, pp, ep, etp, s) for s in range(pp)) * bytes_per_param
    tokens = micro_batch_size * seq_length
    h, d = arch.hidden_size, arch.head_dim
    qkv = (arch.num_attention_heads + 2 * arch.num_query_groups) * d // tp
    if arch.is_moe:
        # Dropless routing: in the worst case every routed copy lands on this rank.
        mlp = tokens * arch.moe_router_topk * (3 * arch.moe_ffn_hidden_size // etp + h) + tokens * arch.num_experts
        mlp += tokens * 3 * arch.moe_shared_expert_ffn_hidden_size // tp  # shared experts: every token
    else:
        mlp = tokens * 3 * arch.ffn_hidden_size // tp
    attention = tokens * (qkv + arch.num_attention_heads * d // tp)
    if not flash_attention:
        attention += micro_batch_size * arch.num_attention_heads // tp * seq_length * seq_length * 2
    residual = 4 * tokens * h  # input, residual, output, one norm copy
    captured = num_captured_layers * tokens * h
    activations = (max(mlp, attention) + residual + captured) * bytes_per_activation
    layout = f"TP={tp} PP={pp} EP={ep} ETP={etp}, micro-batch {micro_batch_size} x {seq_length} tokens"
    return MemoryEstimate(weights, activations, reserve_bytes, layout)


def check_fits(estimate: MemoryEstimate, gpu_memory_gib: float) -> None:
    """Raise TargetMemoryError, with the numbers, when the estimate exceeds `gpu_memory_gib`."""
    budget = gpu_memory_gib * GIB
    if estimate.total_bytes > budget:
        raise TargetMemoryError(
            f"{estimate.summary()}, which exceeds --gpu-memory-gib {gpu_memory_gib:g}; raise "
            f"--tensor-model-parallel-size, --pipeline-model-parallel-size or "
            f"--expert-model-parallel-size, or lower --micro-batch-size / --max-length."
        )


# TTT attention (models/drafter/ttt_attention.py): two query channels carry the sink score (hi + lo), and the
# channel count is padded to the fused kernels' alignment.
TTT_SINK_CHANNELS = 2
TTT_ALIGN = 8


def ttt_attention_saved_bytes(
    batch: int, heads: int, seq: int, head_dim: int, steps: int, dtype_bytes: int = 2, kv_heads: int | None = None
) -> int:
    """Bytes one layer's TTT attention saves for backward over a `steps`-step unroll, beyond its q, k, v inputs.

    Step 0: the fused kernel's output and float32 log-sum-exp, and with grouped-query attention the key and
    value repeated over the groups. Step k > 0: the padded q/k/v copies with the sink row and the kernel's
    output (4 x [b, h, s+1, w]), its log-sum-exp, and the float32 sink weight and merged diagonal value. The
    stacked diagonal keys and values are recomputed in backward, not saved (ttt_attention checkpoints them).
    """
    width = -(-(head_dim + TTT_SINK_CHANNELS) // TTT_ALIGN) * TTT_ALIGN
    rows, padded_rows = batch * heads * seq, batch * heads * (seq + 1)
    total = rows * (head_dim * dtype_bytes + 4)
    if kv_heads is not None and kv_heads != heads:
        total += 2 * rows * head_dim * dtype_bytes
    # The sink weight is a float32 copy of one output channel; in float32 it is a view of the output.
    sink_weight = 4 if dtype_bytes != 4 else 0
    for _ in range(1, steps):
        total += padded_rows * (4 * width * dtype_bytes + 4) + rows * (4 * head_dim + sink_weight)
    return total


def ttt_attention_bytes(
    batch: int, heads: int, seq: int, head_dim: int, steps: int, dtype_bytes: int = 2, kv_heads: int | None = None
) -> int:
    """Peak activation bytes of one layer's TTT attention (what `osprey plan` budgets): what it saves
    (ttt_attention_saved_bytes) plus the backward of the last step, which holds its padded q/k/v gradients
    and the recomputed float32 diagonal (stacked keys and values, the float32 query, scores and probabilities).
    Linear in seq and, summed over steps, quadratic only in the small K.
    """
    total = ttt_attention_saved_bytes(batch, heads, seq, head_dim, steps, dtype_bytes, kv_heads)
    if steps > 1:
        width = -(-(head_dim + TTT_SINK_CHANNELS) // TTT_ALIGN) * TTT_ALIGN
        rows, k = batch * heads * seq, steps - 1
        total += 3 * batch * heads * (seq + 1) * width * dtype_bytes
        total += rows * (2 * k * head_dim + head_dim + 2 * k) * 4
    return total


# The TTT loss (losses/ttt.py) keeps for backward each step's drafter logits as given (its own autograd function
# recomputes the softmaxes in backward) and reads the float32 target logits in place. Its float32 work runs over
# TTT_LOSS_CHUNK_ENTRIES rows x vocabulary entries at a time, three float32 temporaries of that chunk at its peak.
# Measured with a storage tracker over forward and backward in tests/unit/test_ttt_loss.py, in bf16 and float32.
TTT_LOSS_CHUNK_ENTRIES = 1 << 24
TTT_LOSS_CHUNK_BYTES_PER_ENTRY = 12
TTT_TARGET_LOGIT_BYTES = 4  # the TargetHead's float32 logits


def ttt_loss_chunk_rows(local_vocab: int) -> int:
    """Rows of one chunk of the TTT loss's float32 work."""
    return max(1, TTT_LOSS_CHUNK_ENTRIES // max(1, local_vocab))


def ttt_logits_bytes(rows: int, local_vocab: int, steps: int, dtype_bytes: int = 2) -> int:
    """Peak bytes of the LM-head logits and the TTT loss over a `steps`-step unroll on one rank: every step's
    logits in the compute dtype (what the loss keeps), the target's float32 logits, one step's logits gradient in
    backward, and the loss's float32 chunk (TTT_LOSS_CHUNK_BYTES_PER_ENTRY per entry of one chunk)."""
    per_entry = steps * dtype_bytes + TTT_TARGET_LOGIT_BYTES + dtype_bytes
    chunk = min(rows, ttt_loss_chunk_rows(local_vocab)) * local_vocab
    return rows * local_vocab * per_entry + chunk * TTT_LOSS_CHUNK_BYTES_PER_ENTRY


# Bytes per element of the dtypes `osprey eval --dtype` loads a HF target in.
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def estimate_eval_target_memory(arch: ModelArch, dtype: str, tokens: int, batch_size: int = 1) -> MemoryEstimate:
    """The least one device needs to decode with the whole HF target in `dtype` (local `osprey eval`): its
    weights and a KV cache of `tokens` positions per sequence, plus the runtime reserve. Prompts and the
    forward's own activations come on top, so a refusal on this figure is certain."""
    width = DTYPE_BYTES[dtype]
    weights = arch.num_parameters() * width
    kv_cache = 2 * arch.num_layers * arch.num_query_groups * arch.head_dim * tokens * batch_size * width
    layout = f"the whole target in {dtype}, a {tokens}-token KV cache x {batch_size} sequence(s)"
    return MemoryEstimate(weights, kv_cache, RUNTIME_RESERVE_BYTES, layout)


def check_eval_target_fits(
    estimate: MemoryEstimate,
    target: str,
    dtype: str,
    device: str,
    device_bytes: int,
    host_bytes: int,
    host_holds_weights: bool = True,
) -> None:
    """Refuse (TargetMemoryError naming --target and --dtype, with the numbers) a local eval whose target
    cannot fit: transformers first loads the weights into host memory (`host_holds_weights`; the Megatron
    backend reads them slice by slice instead), then moves them to `device`, whose `device_bytes` must hold the
    weights, the KV cache and the runtime reserve (on "cpu", the host's)."""
    on_cpu = device == "cpu"
    need = estimate.weight_bytes + estimate.activation_bytes + (0 if on_cpu else estimate.reserve_bytes)
    problems = []
    if host_holds_weights and estimate.weight_bytes > host_bytes and not on_cpu:
        problems.append(
            f"its weights alone ({estimate.weight_bytes / GIB:.1f} GiB) exceed the host's available "
            f"{host_bytes / GIB:.1f} GiB, where they are loaded first"
        )
    budget = host_bytes if on_cpu else device_bytes
    if need > budget:
        where = "the host's available memory" if on_cpu else f"{device}'s memory"
        problems.append(
            f"it needs at least {need / GIB:.1f} GiB (weights {estimate.weight_bytes / GIB:.1f} GiB + KV cache "
            f"{estimate.activation_bytes / GIB:.1f} GiB"
            + ("" if on_cpu else f" + runtime reserve {estimate.reserve_bytes / GIB:.1f} GiB")
            + f") but {where} is {budget / GIB:.1f} GiB"
        )
    if not problems:
        return
    hint = ""
    if DTYPE_BYTES[dtype] > DTYPE_BYTES["bfloat16"]:
        halved = estimate.weight_bytes // DTYPE_BYTES[dtype] * DTYPE_BYTES["bfloat16"]
        hint = f"pass --dtype bfloat16 ({halved / GIB:.1f} GiB of weights), "
    raise TargetMemoryError(
        f"--target {target} cannot be evaluated locally at --dtype {dtype} ({estimate.layout}): "
        + "; ".join(problems)
        + f". {hint}lower --max-new-tokens, or evaluate it with SGLang on the cluster (the Slurm eval path)."
    )


def target_head_bytes(target: ModelArch, tp: int, draft_vocab: int | None) -> int:
    """Distillation's TargetHead: float32 rows of the LM head per TP rank, plus the draft rows."""
    rows = math.ceil(target.vocab_size / tp)
    if draft_vocab and draft_vocab != target.vocab_size:
        rows += math.ceil(draft_vocab / tp)
    return rows * target.hidden_size * 4
