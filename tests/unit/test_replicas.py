"""Decoding replicas: the connected sets of ranks under the tensor- and expert-parallel relations."""

from megatron_osprey.parallel.replicas import components


def test_tensor_parallel_groups_are_their_own_replicas():
    # world 4, TP 2: {0,1}, {2,3}; EP 1 links nothing more
    assert components([[0, 1], [0, 1], [2, 3], [2, 3]]) == [(0, 1), (2, 3)]


def test_an_expert_group_inside_the_tensor_group_adds_nothing():
    # TP 4, EP 2, ETP 1 on 8 ranks: EP {0,1}, {2,3}, ... lie inside TP {0..3}, {4..7}; each rank's links are its
    # TP group joined with its EP group
    linked = [sorted({*range(4 * (r // 4), 4 * (r // 4) + 4), 2 * (r // 2), 2 * (r // 2) + 1}) for r in range(8)]
    assert components(linked) == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_an_expert_group_across_data_parallel_ranks_joins_them():
    # TP 2, EP 4 (ETP 1) on 8 ranks: TP {0,1},{2,3},{4,5},{6,7}; EP {0..3}, {4..7}
    linked = [[0, 1, 2, 3]] * 4 + [[4, 5, 6, 7]] * 4
    assert components(linked) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    # TP 1, EP 2 on 2 ranks: both data-parallel ranks decode together
    assert components([[0, 1], [0, 1]]) == [(0, 1)]


def test_links_chain_transitively():
    # 0-1 and 1-2 linked by different ranks' groups, 3 alone
    assert components([[0, 1], [1, 2], [2], [3]]) == [(0, 1, 2), (3,)]
