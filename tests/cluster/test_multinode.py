"""Tensor parallelism across nodes: a head and two worker nodes (ray.cluster_utils.Cluster), the ranks
forced apart by STRICT_SPREAD, greedy output identical to the in-process tp=1 engine.

The cluster lives in a child process so that it never meets the session's local Ray."""

import json
import subprocess
import sys
from pathlib import Path

from cluster.engine import InProcessEngine
from tests.cluster.test_ray_engine import config, run_to_completion

ROOT = Path(__file__).resolve().parents[2]


def run_on_three_nodes(model: str) -> dict:
    """In the child: start the cluster, run the prompts at tp=2, report outputs and where each actor ran."""
    import ray
    from ray.cluster_utils import Cluster

    from cluster.ray_engine import RayEngine

    # Each node could hold all three bundles ({CPU: 1} each): only the strategy keeps them apart.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3})
    for _ in range(2):
        cluster.add_node(num_cpus=3)
    cluster.wait_for_nodes()
    try:
        engine = RayEngine(config(model, tensor_parallel_size=2, placement_strategy="STRICT_SPREAD"),
                           address=cluster.address)
        where = lambda _: ray.get_runtime_context().get_node_id()  # noqa: E731
        nodes = ray.get([a.__ray_call__.remote(where) for a in [engine.actor, *engine.workers]])
        strategy = ray.util.placement_group_table(engine.placement_group)["strategy"]
        return {"nodes": nodes, "strategy": strategy, "outputs": run_to_completion(engine)}
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_tp2_across_nodes_matches_tp1(tiny_model_dir):
    model = tiny_model_dir("llama", num_attention_heads=4, num_key_value_heads=2)
    child = subprocess.run([sys.executable, "-m", "tests.cluster.test_multinode", model], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["strategy"] == "STRICT_SPREAD"
    assert len(set(report["nodes"])) == 3  # scheduler, rank 0 and rank 1 each on their own node
    assert report["outputs"] == run_to_completion(InProcessEngine(config(model)))


if __name__ == "__main__":
    print(json.dumps(run_on_three_nodes(sys.argv[1])))
