"""Which GPUs each rank sees: every GPU the engine holds on its node (NCCL needs them for P2P/NVLink)."""

import pytest

from cluster.worker_actor import node_gpu_lists


@pytest.mark.parametrize(
    "node_ids,gpu_ids,expected",
    [
        (["a", "a"], [[1], [0]], ["0,1", "0,1"]),  # one node: both ranks see both GPUs
        (["a", "b", "a", "b"], [[3], [0], [2], [1]], ["2,3", "0,1", "2,3", "0,1"]),  # two nodes, two ranks each
        (["a", "a"], [[10], [9]], ["9,10", "9,10"]),  # numerically, not as text
        (["a", "a"], [["GPU-b"], ["GPU-a"]], ["GPU-a,GPU-b"] * 2),  # UUIDs, as some clusters name them
        (["a", "a"], [[], []], ["", ""]),  # CPU ranks: nothing to set
    ],
)
def test_each_rank_sees_every_gpu_of_its_node(node_ids, gpu_ids, expected):
    assert node_gpu_lists(node_ids, gpu_ids) == expected
