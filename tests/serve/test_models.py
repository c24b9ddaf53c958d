"""Several base models behind one endpoint (`raylm serve --model A --model B`): one deployment and engine per
model behind a ModelRouter that routes by each request's `model`, streams and all, with one metrics scrape
labelled by model; an unknown model is a 404 naming the known ones."""

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import torch
from ray import serve

from engine.config import EngineConfig
from engine.network import free_port
from serve import APP_NAME, AppArgs
from tests.serve.test_server import WAIT_S, metrics, serving

pytestmark = pytest.mark.usefixtures("ray_session")

PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def models(servable_tiny_model, tmp_path_factory) -> dict[str, str]:
    """Two tiny random models that answer differently: "a" and "b", as their served names. "b" is exported as
    sentence-transformers exports an embedding model (modules.json, 1_Pooling asking for mean pooling), so it
    serves /v1/embeddings as well (runner=auto) and "a" does not."""
    b = Path(shutil.copytree(servable_tiny_model(intermediate_size=96), tmp_path_factory.mktemp("st") / "b"))
    (b / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "", "type": "Transformer"}]))
    (b / "1_Pooling").mkdir()
    (b / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return {"a": servable_tiny_model(), "b": str(b)}


@pytest.fixture(scope="module")
def url(models):
    """ "b" runs two replicas: a LoRA adapter loaded through one must reach both."""
    engine = dict(max_model_len=64, kv_cache_bytes=16 << 20, num_threads=1, enable_lora=True)
    apps = [
        AppArgs(
            engine=EngineConfig(model=path, **engine),
            served_model_name=name,
            max_body_bytes=1 << 16,
            min_replicas=1 + (name == "b"),
            max_replicas=1 + (name == "b"),
        )
        for name, path in models.items()
    ]
    with serving(apps, host="127.0.0.1", port=free_port(), grpc_port=free_port()) as url:
        deadline = time.monotonic() + 300
        while serve.status().applications[APP_NAME].deployments["LLMServer-1"].replica_states.get("RUNNING", 0) < 2:
            assert time.monotonic() < deadline, "the second replica of 'b' did not start"
            time.sleep(0.5)
        yield url


def hf_greedy(path: str, new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor([PROMPT])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(PROMPT) :].tolist()


def test_each_model_answers_its_own_requests_streamed_and_not(url, models):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["a"])
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert sorted(m.id for m in client.models.list()) == ["a", "b"]
    assert client.models.retrieve("b").id == "b"
    for name, path in models.items():
        kw = dict(model=name, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        whole = client.completions.create(**kw)
        assert whole.model == name
        assert whole.choices[0].text == tokenizer.decode(hf_greedy(path, 6)), name
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
        assert streamed == whole.choices[0].text
    assert hf_greedy(models["a"], 6) != hf_greedy(models["b"], 6)  # else the routing would go unseen


def test_embeddings_of_the_embedding_model_equal_transformers_mean_pooled(url, models):
    """The SDK's embeddings.create routed to "b" (a sentence-transformers export): its mean-pooled, normalised
    final hidden states, as transformers computes them; "a", a generative model, refuses embeddings naming why."""
    from transformers import AutoModel

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = [PROMPT, list(range(100, 140))]
    got = client.embeddings.create(model="b", input=prompts)
    model = AutoModel.from_pretrained(models["b"], dtype=torch.float32).eval()
    for prompt, d in zip(prompts, got.data):
        with torch.no_grad():
            mean = model(torch.tensor([prompt])).last_hidden_state[0].mean(0)
        assert torch.tensor(d.embedding) == pytest.approx(torch.nn.functional.normalize(mean, dim=0), abs=1e-4)
    assert got.model == "b" and got.usage.prompt_tokens == sum(map(len, prompts))
    with pytest.raises(openai.BadRequestError, match="runner pooling"):
        client.embeddings.create(model="a", input=PROMPT)


def test_an_unknown_model_is_a_404_naming_the_known_ones(url):
    r = httpx.post(f"{url}/v1/completions", json={"model": "c", "prompt": "hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert "'a'" in error["message"] and "'b'" in error["message"]
    assert httpx.get(f"{url}/v1/models/c", timeout=60).status_code == 404
    big = httpx.post(f"{url}/v1/completions", json={"model": "a", "prompt": "x" * (1 << 16)}, timeout=60)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200


def test_one_metrics_scrape_labels_each_models_series(url):
    for name in ("a", "b"):
        httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2}, timeout=60)
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(f"{url}/metrics", timeout=60).text
        lines = [line for line in text.splitlines() if line.startswith("vllm:")]
        seen = {name for name in ("a", "b") if any(f'model_name="{name}"' in line for line in lines)}
        if seen == {"a", "b"} or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert seen == {"a", "b"}


def served_by_replica(url: str, model: str) -> dict[str, float]:
    """Finished requests of `model`'s deployment per replica, from one scrape."""
    out: dict[str, float] = {}
    for key, value in metrics(url, by_replica=True).items():
        if key.startswith("vllm:request_success_total{") and f"model_name={model}," in key:
            replica = key.split("replica=")[1].split(",")[0].rstrip("}")
            out[replica] = out.get(replica, 0) + value
    return out


def test_a_lora_adapter_loads_through_the_router_into_every_replica_of_its_model(url, models, tmp_path):
    """vLLM's load body names no base: the adapter of "b" (its MLP shapes are b's) is refused by "a" and loads
    into "b", into both its replicas: requests naming it reach "b"'s deployment, and each replica answers them
    with peft's tokens; unloaded, its name is a 404 again."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.workers.adapters import make_adapter

    adapter = make_adapter(models["b"], tmp_path / "b-lora", 3, r=4, lora_alpha=8, target_modules=["down_proj"])
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(models["b"], dtype=torch.float32), adapter)
    x = torch.tensor([PROMPT])
    expected = peft.eval().generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    expected = AutoTokenizer.from_pretrained(models["b"]).decode(expected[0, len(PROMPT) :])
    body = {"lora_name": "b-lora", "lora_path": adapter}
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)
    assert r.status_code == 200, r.text
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert {m.id: m.parent for m in client.models.list()}["b-lora"] == "b"
    kw = dict(model="b-lora", prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    before = served_by_replica(url, "b")
    deadline = time.monotonic() + WAIT_S
    with ThreadPoolExecutor(6) as pool:  # at once, so that load spreads them over both replicas
        while True:
            outs = list(pool.map(lambda _: client.completions.create(**kw), range(6)))
            assert [(o.model, o.choices[0].text) for o in outs] == [("b-lora", expected)] * 6
            after = served_by_replica(url, "b")
            answered = [k for k, v in after.items() if v > before.get(k, 0)]
            if len(answered) == 2 or time.monotonic() > deadline:
                break
    assert len(answered) == 2, (before, after)
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "b-lora"}, timeout=60)
    assert r.status_code == 200, r.text
    assert "b-lora" not in {m.id for m in client.models.list()}
    for _ in range(4):
        r = httpx.post(f"{url}/v1/completions", json={"model": "b-lora", "prompt": "hi", "max_tokens": 1}, timeout=60)
        assert r.status_code == 404, r.text
