"""KV-cache events on the wire (engine/kv_events.py), read as a router reads vLLM's: a pyzmq SUB socket and
msgpack. The in-process engine on a tiny model, with a cache small enough to evict, publishes one batch per step
that changed the cache, numbered from 0 without a gap; the replay socket gives every batch again; replayed in order,
the batches store and remove each hash once and leave exactly the hashes the engine's block pool holds. An endpoint
that cannot be opened is refused at start, naming it."""

import msgpack
import pytest
import zmq

from engine.config.kv_events import DEFAULTS
from engine.inprocess import InProcessEngine
from engine.kv_events import END_OF_REPLAY, KVEventPublisher, wire_hash
from raylm import EngineConfig, SamplingParams
from scheduler import EngineRequest

BLOCK = 4
WAIT_MS = 30_000  # a generous bound for a message already sent, never a timing assertion


def receive_until(sub: zmq.Socket, last: int) -> dict[int, bytes]:
    """The live batches, by sequence number, up to batch ``last`` (the ones before the subscription took are lost,
    as ZMQ's PUB drops what no subscriber has asked for yet)."""
    got = {}
    while last not in got:
        assert sub.poll(WAIT_MS), "a published batch never arrived"
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        got[int.from_bytes(seq, "big")] = payload
    return got


def replay_all(endpoint: str) -> dict[int, bytes]:
    dealer = zmq.Context.instance().socket(zmq.DEALER)  # many replies to one request: a REQ would take one
    dealer.connect(endpoint)
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    got = {}
    while True:
        assert dealer.poll(WAIT_MS), "the replay never ended"
        _, seq, payload = dealer.recv_multipart()
        if seq == END_OF_REPLAY:
            dealer.close(linger=0)
            return got
        got[int.from_bytes(seq, "big")] = payload


def test_a_subscriber_reads_every_step_and_the_batches_replay_to_the_block_pool(tiny_model_dir, tmp_path):
    endpoint, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv-replay"
    spec = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay, "topic": "kv"}
    engine = InProcessEngine(
        EngineConfig(
            model=tiny_model_dir("llama"),
            device="cpu",
            block_size=BLOCK,
            kv_cache_bytes=24 * 1024,
            kv_events_config=spec,
        )
    )
    assert engine.num_blocks < 40  # small enough that the prompts below evict each other's blocks
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)
    shared = list(range(3, 15))  # three full blocks every prompt starts with: later prompts hit them
    for i in range(12):
        prompt = shared + [20 + i] * (5 + 3 * (i % 4))
        request = EngineRequest(
            request_id=str(i), prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=6, ignore_eos=True)
        )
        engine.add_request(request)
        if i % 3 == 2:
            while engine.has_unfinished_requests():
                engine.step()
    last = engine.kv_events.seq - 1
    live = receive_until(sub, last)
    batches = replay_all(replay)
    pool = engine.scheduler.kv.block_pool
    held = {wire_hash(h) for h in pool.cached_blocks}
    engine.shutdown()
    sub.close(linger=0)

    assert sorted(batches) == list(range(last + 1)) and last > 3
    assert all(batches[seq] == payload for seq, payload in live.items())  # live and replayed: the same bytes
    assert sorted(live) == list(range(min(live), last + 1))  # what a subscriber got has no gap
    state: set[int] = set()
    kinds = set()
    for seq in range(last + 1):
        ts, events, dp_rank = msgpack.unpackb(batches[seq])
        assert isinstance(ts, float) and dp_rank == 0 and events
        for event in events:
            kinds.add(event[0])
            if event[0] == "BlockStored":
                hashes, parent, tokens, block_size, lora_id, medium, lora_name, extra_keys, group_idx = event[1:]
                assert (block_size, lora_id, medium, lora_name, extra_keys, group_idx) == (
                    BLOCK,
                    None,
                    "GPU",
                    None,
                    None,
                    None,
                )
                assert len(tokens) == BLOCK * len(hashes) and (parent is None or parent in state)
                assert not state & set(hashes)
                state |= set(hashes)
            elif event[0] == "BlockRemoved":
                assert event[2:] == ["GPU", None] and set(event[1]) <= state
                state -= set(event[1])
            else:
                assert event == ["AllBlocksCleared"] and seq == 0 and event is events[0]
                state.clear()
    assert kinds == {"AllBlocksCleared", "BlockStored", "BlockRemoved"}
    assert state == held


def test_an_endpoint_in_use_is_refused_naming_it():
    taken = zmq.Context.instance().socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://*:{port}"
    with pytest.raises(ValueError, match=f"endpoint '{endpoint.replace('*', '[*]')}' cannot be opened"):
        KVEventPublisher({**DEFAULTS, "endpoint": endpoint}, BLOCK)
    taken.close(linger=0)
