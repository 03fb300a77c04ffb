"""A Megatron-Core target for the reference speculative decoder (chains and draft trees).

The Megatron-Core model runs without an inference KV cache here: every prefill or
verify recomputes the committed sequence plus the new tokens and returns the new
rows. The committed prefix is causal; draft tokens see all of it plus the tree
rows `allowed` lets them see, at positions cache_len + depth (the rotary table is
indexed by those positions, not by sequence order). That is exact, and keeps the
adapter small; it costs O(length) work per verify, so it is for checking a
Megatron target's acceptance length, not for speed.

A model built with Transformer Engine layers (what megatron-core needs on CUDA for a mixture-of-experts target
or sequence parallelism) attends with its causal mask type, not an explicit mask: it verifies chains only (a
chain's mask is the causal one, its positions the sequence's), and a tree verify is refused. So does a target with
sliding-window layers (Mistral, Gemma 3, gpt-oss): its window counts sequence rows, which are positions in a chain only.
And so does multi-latent attention (DeepSeek-V3, Kimi-K2): Megatron-Core's MLA applies RoPE by sequence row (it takes
no positions), which equal the positions in a chain only.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from megatron_osprey.models.target.decoding import TargetModel


class MegatronTargetModel(TargetModel):
    """TargetModel over a Megatron-Core GPTModel (with its LM head) and layer hooks: one rank, or one
    tensor-parallel group, with or without sequence parallelism, dense or mixture-of-experts (experts over an
    expert-parallel group); no pipeline parallelism. Every rank gets the full logits and aux rows.

    `sync_group`: a group of ranks that decode the same sequence in step without sharing a tensor-parallel group
    (data-parallel ranks of one expert-parallel group); its first rank's logits and aux rows are broadcast to
    the others, so that every rank takes the same greedy decisions and runs the same number of forwards."""

    def __init__(self, model, aux_layer_ids: list[int], vocab_size: int, sync_group=None, causal_only=None):
        from megatron_osprey.models.target.pipeline_stage import LayerCapture

        self.model = model
        self.aux_layer_ids = list(aux_layer_ids)
        self.vocab_size = vocab_size
        self.capture = LayerCapture(model, self.aux_layer_ids)
        self._committed = torch.zeros(0, dtype=torch.long)
        self._pending: torch.Tensor | None = None
        self.tp_size = 1
        self.sequence_parallel = bool(getattr(model.config, "sequence_parallel", False))
        self.sync_group = sync_group
        # MLA rotates queries and keys itself, by sequence row; the other attentions take the model's RoPE table.
        self.row_rope = bool(getattr(model.config, "multi_latent_attention", False))
        # None: from the model (Transformer Engine layers attend with the causal mask type only; a sliding window
        # and MLA's RoPE count rows, which are positions in a chain only).
        if causal_only is None:
            causal_only = (
                uses_transformer_engine(model) or bool(getattr(model.config, "window_size", None)) or self.row_rope
            )
        self.causal_only = causal_only
        if torch.distributed.is_initialized():
            from megatron.core import parallel_state as mpu

            if mpu.model_parallel_is_initialized():
                self.tp_size = mpu.get_tensor_model_parallel_world_size()

    @classmethod
    @contextlib.contextmanager
    def open(cls, target_dir: str | Path, aux_layer_ids: list[int]) -> Iterator["MegatronTargetModel"]:
        """Build the target from its HF directory in a one-rank Megatron-Core context."""
        from megatron_osprey.models.target.pipeline_stage import load_target
        from megatron_osprey.parallel import ParallelConfig, parallel_context

        with parallel_context(ParallelConfig()) as state:
            stage = load_target(target_dir, state.config, state.device, with_lm_head=True, transformer_impl="local")
            target = cls(stage.model, aux_layer_ids, stage.arch.vocab_size)
            try:
                yield target
            finally:
                target.capture.remove()

    @classmethod
    def load(
        cls,
        target_dir: str | Path,
        parallel,
        device,
        aux_layer_ids: list[int],
        *,
        params_dtype: torch.dtype = torch.float32,
        transformer_impl: str = "auto",
        sync_group=None,
        arch=None,
    ) -> "MegatronTargetModel":
        """This rank's shard of the target (with its LM head) at the layout of `parallel`, inside its process
        groups; `sync_group`: parallel/replicas.py's decoding_replica().sync_group."""
        from megatron_osprey.models.target.pipeline_stage import load_target

        stage = load_target(
            target_dir,
            parallel,
            device,
            params_dtype=params_dtype,
            with_lm_head=True,
            transformer_impl=transformer_impl,
            arch=arch,
        )
        return cls(stage.model, aux_layer_ids, stage.arch.vocab_size, sync_group=sync_group)

    @property
    def cache_length(self) -> int:
        return int(self._committed.numel())

    def _padded(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor):
        """Under sequence parallelism the length must divide over the tensor-parallel ranks: pad rows at the end
        (token 0, position 0) that see only themselves and that no real row sees."""
        pad = -ids.numel() % self.tp_size if self.sequence_parallel else 0
        if not pad:
            return ids, positions, visible
        n = ids.numel()
        grown = torch.eye(n + pad, dtype=torch.bool)
        grown[:n, :n] = visible
        return torch.cat([ids, ids.new_zeros(pad)]), torch.cat([positions, positions.new_zeros(pad)]), grown

    def rows(self, hidden: torch.Tensor, length: int) -> torch.Tensor:
        """A captured layer output ([s, 1, h], or its [s/TP, 1, h] shard under sequence parallelism) as the
        sequence's first `length` rows, [length, h]."""
        if self.sequence_parallel:
            from megatron_osprey.models.target.pipeline_stage import gather_sequence

            hidden = gather_sequence(hidden)
        return hidden[:length, 0]

    @torch.no_grad()
    def _run(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor, new: int):
        """Logits and aux rows of the last `new` tokens; visible[i, j]: token i attends to token j."""
        model, n = self.model, ids.numel()
        if self.causal_only:
            _check_causal(visible, positions)
        # The committed sequence is kept on the CPU; the model may sit on a GPU.
        device = next(model.parameters()).device
        length = int(positions.max()) + 1
        ids, positions, visible = (t.to(device) for t in self._padded(ids, positions, visible))
        hidden = model.embedding(input_ids=ids[None], position_ids=positions[None])  # scattered under SP
        rotary = None if self.row_rope else model.rotary_pos_emb(length)[positions]
        self.capture.clear()
        mask = None if self.causal_only else ~visible[None, None]  # causal only: the layers' own causal mask
        hidden = model.decoder(hidden_states=hidden, attention_mask=mask, rotary_pos_emb=rotary)
        logits = self._new_logits(self.rows(hidden, n)[n - new :, None])
        aux = torch.cat([self.rows(self.capture.outputs[i], n)[-new:] for i in self.aux_layer_ids], dim=-1)
        self.capture.clear()
        logits, aux = logits[:, 0, : self.vocab_size].float().contiguous(), aux.float().contiguous()
        if self.sync_group is not None:
            source = torch.distributed.get_process_group_ranks(self.sync_group)[0]
            for tensor in (logits, aux):
                torch.distributed.broadcast(tensor, source, group=self.sync_group)
        return logits, aux

    def _new_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over the new rows only ([new, 1, h], whole: no sequence shard), every rank the full
        vocabulary: not the whole recomputed sequence's logits (a [length, vocab] tensor per verify)."""
        model = self.model
        weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        head, sequence_parallel = model.output_layer, model.output_layer.sequence_parallel
        head.sequence_parallel = False  # the rows are gathered already (as GPTModel does for last-token logits)
        try:
            logits, _ = head(hidden, weight=weight)
        finally:
            head.sequence_parallel = sequence_parallel
        if self.tp_size > 1:  # each tensor-parallel rank holds a vocabulary slice: every rank gets all of it
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            logits = gather_from_tensor_model_parallel_region(logits)
        return logits

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._committed = input_ids.detach().cpu().long()
        self._pending = None
        n = self._committed.numel()
        return self._run(self._committed, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(), n)

    def verify(self, tokens: torch.Tensor, depths: torch.Tensor, allowed: torch.Tensor):
        if self._pending is not None:
            raise RuntimeError("MegatronTargetModel.verify called twice without commit in between.")
        n, m = self.cache_length, tokens.numel()
        self._pending = (tokens.detach().cpu().long(), depths.detach().cpu().long())
        visible = torch.zeros(n + m, n + m, dtype=torch.bool)
        visible[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        visible[n:, :n] = True
        visible[n:, n:] = allowed.cpu().bool()
        positions = torch.cat([torch.arange(n), n + self._pending[1]])
        return self._run(torch.cat([self._committed, self._pending[0]]), positions, visible, m)

    def commit(self, keep: list[int]) -> None:
        # The kept rows form one root-to-leaf path: in order they continue the committed sequence.
        self._committed = torch.cat([self._committed, self._pending[0][keep]])
        self._pending = None


def uses_transformer_engine(model) -> bool:
    """Whether `model` was built with Transformer Engine layers (megatron-core's TE extension)."""
    return any(type(m).__module__.startswith("megatron.core.extensions.transformer_engine") for m in model.modules())


def _check_causal(visible: torch.Tensor, positions: torch.Tensor) -> None:
    """Refuse what a causal-only target cannot verify: a tree (a mask other than the causal one)."""
    n = visible.shape[0]
    if not torch.equal(visible.cpu(), torch.ones(n, n, dtype=torch.bool).tril()) or not torch.equal(
        positions.cpu(), torch.arange(n)
    ):
        raise ValueError(
            "a Transformer Engine target, or one with sliding-window layers or multi-latent attention, verifies "
            "chains only (--topk 1): its attention takes the causal mask type, not a tree's mask; use "
            "--transformer-impl local for draft trees (a target without sliding windows or MLA)."
        )
