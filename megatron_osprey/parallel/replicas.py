"""Decoding replicas: the ranks that must run the same sequence through the target in step.

A tensor-parallel group decodes one sequence together. A mixture-of-experts layer exchanges tokens over its
expert tensor- and model-parallel group, so when that group reaches past the tensor-parallel group
(--expert-model-parallel-size x --expert-tensor-parallel-size larger than --tensor-model-parallel-size) its
data-parallel ranks must also run every forward together. A
replica is a connected set of ranks under both relations: each replica decodes its own slice of the prompts.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Replica:
    """This rank's replica: its index among `count`, its ranks, and whether this rank writes its results."""

    index: int
    count: int
    ranks: tuple[int, ...]
    # Set when the replica spans data-parallel ranks: they compute the same values apart from summation order,
    # so the first rank's are broadcast over this group before any decision is taken on them.
    sync_group: object | None

    @property
    def is_writer(self) -> bool:
        import torch

        return torch.distributed.get_rank() == self.ranks[0]


def components(linked: list[list[int]]) -> list[tuple[int, ...]]:
    """The connected sets of ranks, each sorted, in order of their first rank; linked[r]: the ranks r runs with."""
    parent = list(range(len(linked)))

    def root(rank: int) -> int:
        while parent[rank] != rank:
            parent[rank] = parent[parent[rank]]
            rank = parent[rank]
        return rank

    for ranks in linked:
        for rank in ranks:
            parent[root(rank)] = root(ranks[0])
    groups: dict[int, list[int]] = {}
    for rank in range(len(linked)):
        groups.setdefault(root(rank), []).append(rank)
    return sorted(tuple(ranks) for ranks in groups.values())


def decoding_replica() -> Replica:
    """Collective over the world (after Megatron-Core's model-parallel groups exist): this rank's replica."""
    import torch
    from megatron.core import parallel_state as mpu

    ranks = set(torch.distributed.get_process_group_ranks(mpu.get_tensor_model_parallel_group()))
    if mpu.get_expert_model_parallel_world_size() > 1 or mpu.get_expert_tensor_parallel_world_size() > 1:
        # The MoE dispatcher exchanges tokens over the expert tensor- and model-parallel group (ETP x EP).
        ranks |= set(torch.distributed.get_process_group_ranks(mpu.get_expert_tensor_and_model_parallel_group()))
    linked: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(linked, sorted(ranks))
    replicas = components(linked)
    tp_size = mpu.get_tensor_model_parallel_world_size()
    sync_group = None
    for replica in replicas:  # every rank creates every group, in the same order
        if len(replica) > tp_size:
            group = torch.distributed.new_group(list(replica))
            if torch.distributed.get_rank() in replica:
                sync_group = group
    index = next(i for i, replica in enumerate(replicas) if torch.distributed.get_rank() in replica)
    return Replica(index, len(replicas), replicas[index], sync_group)
