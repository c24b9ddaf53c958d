"""KV-cache events on the wire as vLLM publishes them (``--kv-events-config``), so that the routers that read
vLLM's, llm-d's KV-cache-aware scheduler and NVIDIA Dynamo's KV router among them, read raylm's unchanged.

The wire, vLLM's ZmqEventPublisher's (msgspec's array-like tagged structs, in msgpack):

- one ZMQ message per engine step that changed the cache, three frames: the topic (UTF-8), the batch's sequence
  number (8 bytes, big-endian, from 0), the payload;
- the payload, a KVEventBatch: ``[ts, events, data_parallel_rank]``, ``ts`` seconds since the epoch (a float),
  ``data_parallel_rank`` 0 (raylm scales by replicas, each its own publisher);
- the events, in the order the cache changed: ``["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name, extra_keys, group_idx]``, ``["BlockRemoved", block_hashes, medium,
  group_idx]``, ``["AllBlocksCleared"]``. ``medium`` is "GPU" for the engine's KV cache, "CPU" for the host tier;
  ``lora_id`` is None (raylm names adapters: ``lora_name`` carries the name, and the hashes already differ per
  adapter); ``extra_keys`` and ``group_idx`` are None (one KV-cache group). msgspec writes an array-like struct's
  every field, defaults included, so these are the bytes vLLM's structs of this layout encode to; a decoder
  declaring fewer fields (vLLM's older layouts) ignores the trailing ones.

Block hashes: raylm's are 16-byte xxh3_128 digests (scheduler/block_hash.py); on the wire each is the unsigned
64-bit integer of its last 8 bytes, big-endian, as vLLM sends its own by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES):
Dynamo's and llm-d's decoders read 64-bit integers, not bytes. A router keys its index on them; 64 bits keep a
collision between an engine's live blocks out of reach.

Replay (``replay_endpoint``, a ROUTER socket): a request ``[b"", start_seq (8 bytes, big-endian)]`` from a DEALER
socket is answered with each batch still buffered (the last ``buffer_steps``) from ``start_seq`` on, as
``[b"", seq, payload]``, then ``[b"", -1 (8 bytes, signed), b""]`` (a REQ socket would read the first answer only).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgpack
import zmq

from engine.config.kv_events import binds
from scheduler.block_hash import BlockHash
from scheduler.kv_events import BlockRemoved, BlockStored, KVEvent

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
logger = logging.getLogger(__name__)


def wire_hash(block_hash: BlockHash) -> int:
    return int.from_bytes(block_hash[-8:], "big")


def wire_event(event: KVEvent, block_size: int) -> list:
    if type(event) is BlockStored:
        parent = event.parent_block_hash
        return [
            "BlockStored",
            [wire_hash(h) for h in event.block_hashes],
            None if parent is None else wire_hash(parent),
            event.token_ids,
            block_size,
            None,
            event.medium,
            event.lora_name,
            None,
            None,
        ]
    if type(event) is BlockRemoved:
        return ["BlockRemoved", [wire_hash(h) for h in event.block_hashes], event.medium, None]
    return ["AllBlocksCleared"]


def encode_batch(ts: float, events: list[KVEvent], block_size: int) -> bytes:
    return msgpack.packb([ts, [wire_event(e, block_size) for e in events], 0])


class KVEventPublisher:
    """Publishes each step's KV-cache events over ZMQ from a thread of its own, so the step loop never waits on a
    socket or an encoder.

    Invariants: ``publish`` never blocks (a full queue drops the batch and logs it; its sequence number is still
    spent, so subscribers see the gap and can replay or resync); sequence numbers follow the order ``publish`` was
    called in; only the thread touches the sockets once it runs, and it closes them when ``close`` stops it.
    """

    def __init__(self, config: dict[str, Any], block_size: int) -> None:
        self.block_size = block_size
        self.topic = config["topic"].encode()
        self.queue: queue.Queue = queue.Queue(maxsize=config["max_queue_size"])
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config["buffer_steps"])
        self.seq = 0
        self.num_dropped = 0
        context = zmq.Context.instance()
        self.pub = context.socket(zmq.PUB)
        self.pub.set_hwm(config["hwm"])
        self.replay = context.socket(zmq.ROUTER) if config["replay_endpoint"] else None
        try:
            endpoint = config["endpoint"]
            (self.pub.bind if binds(endpoint) else self.pub.connect)(endpoint)
            if self.replay is not None:
                endpoint = config["replay_endpoint"]
                self.replay.bind(endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv_events_config endpoint {endpoint!r} cannot be opened: {e}") from None
        self.thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events as the next batch (none: nothing is sent)."""
        if not events:
            return
        seq, self.seq = self.seq, self.seq + 1
        try:
            self.queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            logger.warning("KV-event batch %d dropped: %d batches queued (max_queue_size)", seq, self.queue.qsize())

    def close(self) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        self.queue.put(None)
        self.thread.join()

    def _run(self) -> None:
        wait = None if self.replay is None else 0.05  # the replay socket is polled between batches
        while True:
            if self.replay is not None and self.replay.poll(0):
                self._answer_replay()
            try:
                batch = self.queue.get(timeout=wait)
            except queue.Empty:
                continue
            if batch is None:
                break
            seq, ts, events = batch
            payload = encode_batch(ts, events, self.block_size)
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            self.buffer.append((seq, payload))
        self._close_sockets()

    def _answer_replay(self) -> None:
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV-event replay request of %d frames ignored: expected [start_seq]", len(frames) - 2)
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in self.buffer:
            if seq >= start:
                self.replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((identity, b"", END_OF_REPLAY, b""))

    def _close_sockets(self) -> None:
        self.pub.close(linger=1000)  # what is still in ZMQ's queue gets a second to leave
        if self.replay is not None:
            self.replay.close(linger=0)
