"""``kv_events_config`` as vLLM spells it: completed with vLLM's defaults, a bad key, value or endpoint refused at
start naming it, events off unless enabled with the zmq publisher."""

import pytest

from engine.config import EngineConfig
from engine.config.kv_events import DEFAULTS, binds


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"enable_kv_cache_events": True, "event_format": "json"}, r"unknown keys \['event_format'\]"),
        ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher='kafka'"),
        ({"enable_kv_cache_events": True, "endpoint": "tcp//*:5557"}, "endpoint='tcp//\\*:5557' is not a ZMQ"),
        ({"enable_kv_cache_events": True, "endpoint": "tcp://*:65536"}, "endpoint='tcp://\\*:65536'"),
        ({"enable_kv_cache_events": True, "endpoint": "tcp://host"}, "endpoint='tcp://host'"),
        ({"enable_kv_cache_events": True, "endpoint": "ipc://"}, "endpoint='ipc://'"),
        ({"enable_kv_cache_events": True, "replay_endpoint": "5558"}, "replay_endpoint='5558'"),
        ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events='yes'"),
        ({"enable_kv_cache_events": True, "buffer_steps": 0}, "buffer_steps=0"),
        ({"enable_kv_cache_events": True, "hwm": -1}, "hwm=-1"),
        ({"enable_kv_cache_events": True, "max_queue_size": 1.5}, "max_queue_size=1.5"),
        ({"enable_kv_cache_events": True, "topic": 7}, "topic=7"),
    ],
)
def test_a_bad_key_value_or_endpoint_is_refused_naming_it(spec, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(device="cpu", kv_events_config=spec)


def test_events_need_the_prefix_cache():
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        EngineConfig(device="cpu", enable_prefix_caching=False, kv_events_config={"enable_kv_cache_events": True})


def test_vllms_defaults_complete_the_config_and_events_are_off_unless_published():
    on = EngineConfig(device="cpu", kv_events_config='{"enable_kv_cache_events": true, "topic": "kv"}')
    assert on.kv_events == {**DEFAULTS, "enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv"}
    for off in ({"enable_kv_cache_events": False}, {"enable_kv_cache_events": True, "publisher": "null"}):
        assert EngineConfig(device="cpu", kv_events_config=off).kv_events is None
    assert EngineConfig(device="cpu").kv_events is None


def test_wildcard_ipc_and_inproc_endpoints_bind_and_named_hosts_connect():
    assert binds("tcp://*:5557") and binds("tcp://[::]:5557") and binds("ipc:///tmp/kv") and binds("inproc://kv")
    assert not binds("tcp://router.example:5557") and not binds("tcp://10.0.0.7:5557")
