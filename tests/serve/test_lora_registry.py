"""The registry of a deployment's LoRA adapters (serve/lora_registry.py), reaching each engine through its
client's EngineAdapters, with engines that keep a set of names the way the scheduler actor does (refusing a taken
or absent name, an unknown path, or an adapter in use): a change reaches every engine or none, a replica joining
late is brought up to date, a dead one leaves."""

import pytest
import ray

from engine.adapters import EngineAdapters
from serve.lora_registry import LoraRegistry

pytestmark = pytest.mark.usefixtures("ray_session")


@ray.remote(num_cpus=0)
class Engine:
    def __init__(self, names: list[str], in_use: set[str] = frozenset()) -> None:
        self.names, self.in_use = set(names), set(in_use)

    def list_loras(self) -> list[str]:
        return sorted(self.names)

    def add_lora(self, name: str, path: str) -> None:
        if name in self.names or path == "/missing":
            raise ValueError(f"LoRA adapter {name!r}: refused")
        self.names.add(name)

    def remove_lora(self, name: str) -> None:
        if name in self.in_use:
            raise ValueError(f"LoRA adapter {name!r}: requests running with it have not finished")
        self.names.remove(name)


def test_changes_reach_every_engine_or_none_and_late_replicas_catch_up():
    registry = LoraRegistry.options(num_cpus=0).remote({"sql": "/sql"})
    one, two = Engine.remote(["sql"]), Engine.remote(["sql"], in_use={"chat"})
    assert ray.get(registry.join.remote("one", EngineAdapters(one))) == {"sql": "/sql"}
    ray.get(registry.join.remote("two", EngineAdapters(two)))
    assert ray.get(registry.load.remote("chat", "/chat")) is None
    assert ray.get([e.list_loras.remote() for e in (one, two)]) == [["chat", "sql"]] * 2
    assert "'chat'" in ray.get(registry.load.remote("chat", "/chat"))  # taken
    assert "'bad'" in ray.get(registry.load.remote("bad", "/missing"))  # every engine refuses: none keeps it
    # "chat" runs on two: the unload is refused and one, which had dropped it, gets it back.
    assert "have not finished" in ray.get(registry.unload.remote("chat"))
    assert ray.get([e.list_loras.remote() for e in (one, two)]) == [["chat", "sql"]] * 2
    assert ray.get(registry.unload.remote("sql")) is None  # a start-up adapter, from every engine
    assert "not loaded" in ray.get(registry.unload.remote("sql"))
    # A replica started now, its engine holding the start-up adapters, joins holding exactly the registry's.
    late = Engine.remote(["sql"])
    assert ray.get(registry.join.remote("late", EngineAdapters(late))) == {"chat": "/chat"}
    assert ray.get(late.list_loras.remote()) == ["chat"]
    ray.kill(two)  # its replica died: it leaves, and the others still change
    assert ray.get(registry.load.remote("new", "/new")) is None
    assert ray.get([e.list_loras.remote() for e in (one, late)]) == [["chat", "new"]] * 2
    assert ray.get(registry.listed.remote()) == {"chat": "/chat", "new": "/new"}
