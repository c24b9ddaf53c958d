"""`raylm bench soak` for half a minute against a server under the priority policy (a tiny random Llama with the
default model's tokenizer, so generation is fast and the mix covers many requests): no 5xx, no stream error,
nothing left in the engine once it drains, and the replica's and the scheduler's resident memory within MAX_GROWTH
of the start (after a warm-up at the same rate). Every request carries a random priority, so requests overtake and
preempt each other: the paths of first-come-first-served and more. (One server, not one per policy: each costs
two minutes of the suite.) This catches only a gross leak; the 10-minute runs of both policies are in README."""

import pytest

from bench.soak import KINDS, check, soak
from engine.config import EngineConfig
from engine.network import free_port
from serve import AppArgs
from tests.serve.test_server import serving

pytestmark = pytest.mark.usefixtures("ray_session")

MODEL = "tiny"
RATE = 4.0  # requests per second
DURATION_S = 30.0
MAX_GROWTH = 0.10  # resident memory of the replica and of the scheduler, end over start


@pytest.fixture(scope="module")
def server(servable_tiny_model):
    path = servable_tiny_model(max_position_embeddings=512)
    args = AppArgs(
        engine=EngineConfig(
            model=path, kv_cache_bytes=16 << 20, num_threads=1, max_num_seqs=16, scheduling_policy="priority"
        ),
        served_model_name=MODEL,
    )
    with serving(args, host="127.0.0.1", port=free_port(), grpc_port=free_port()) as url:
        yield url


def test_a_soak_leaves_no_5xx_no_leak_and_bounded_memory(server):
    report = soak(server, MODEL, RATE, DURATION_S, max_tokens=24, warmup_s=10.0, window_s=10.0, priorities=True)
    report.print()
    assert len(report.outcomes) == int(RATE * DURATION_S) and {o.kind for o in report.outcomes} == set(KINDS)
    assert check(report, MAX_GROWTH) == []
