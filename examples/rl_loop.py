"""A small RL loop on Ray, as verl and OpenRLHF drive an engine: a trainer actor (transformers + torch, the default
model) and a raylm engine at tp=3, three rounds of rollouts -> reward -> policy-gradient step -> weights broadcast.

Each round: the engine samples 4 answers to each capital-city question; the reward is 1 where the answer names the
city; the trainer takes one REINFORCE step (each answer's advantage is its reward less its question's mean); the
engine sleeps (its KV cache freed) while the trainer steps, wakes its weights, receives the new ones from the
trainer over one gloo group (the trainer is rank 0, the engine's ranks 1 to 3) in buckets, resets its prefix
cache and wakes its KV cache. It prints the mean reward per round and the seconds in generation, training, the
weight update and sleep/wake.

Three ranks, not two: the default model's 9 attention heads (3 KV heads) do not split over 2 ranks. A model whose
heads do runs at any tp with `--model DIR --tp N`.

    .venv/bin/python examples/rl_loop.py            # about two minutes on 2 cores
"""

from __future__ import annotations

import argparse
import socket
import time

import ray
import torch

QUESTIONS = {
    "France": "Paris",
    "Japan": "Tokyo",
    "Italy": "Rome",
    "Egypt": "Cairo",
    "Canada": "Ottawa",
    "Kenya": "Nairobi",
}
GROUP = "rl-example"
SAMPLES = 4


@ray.remote(num_cpus=1)
class Trainer:
    """The policy in transformers, its optimizer, and rank 0 of the weight-update group."""

    def __init__(self, model_path: str, lr: float) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.sender = None
        self.buckets: list = []

    def address(self) -> str:
        return ray.util.get_node_ip_address()

    def join(self, address: str, port: int, world_size: int) -> None:
        from workers.weight_group import WeightSender

        self.sender = WeightSender(address, port, world_size, GROUP)

    def step(self, prompts: list[list[int]], completions: list[list[int]], advantages: list[float]) -> float:
        """One REINFORCE step: minimise -advantage x log p(completion | prompt), summed over the batch."""
        self.model.train()
        self.optimizer.zero_grad()
        total = 0.0
        for prompt, completion, advantage in zip(prompts, completions, advantages):
            if not advantage or not completion:
                continue
            ids = torch.tensor([prompt + completion])
            logits = self.model(ids).logits[0, len(prompt) - 1 : -1]
            logprob = torch.log_softmax(logits.float(), -1).gather(1, ids[0, len(prompt) :, None]).sum()
            loss = -advantage * logprob / len(prompts)
            loss.backward()
            total += loss.item()
        self.optimizer.step()
        return total

    def plan(self, bucket_bytes: int) -> list[tuple[list[str], list[str], list[list[int]]]]:
        """The buckets of the next broadcast (Hugging Face names; a tied head is the embedding's tensor)."""
        named = [(name, p.detach()) for name, p in self.model.named_parameters()]
        self.buckets = self.sender.buckets(named, bucket_bytes)
        return [self.sender.bucket_metadata(b) for b in self.buckets]

    def send(self, index: int) -> None:
        self.sender.send(self.buckets[index])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rollouts(llm, params) -> tuple[list[list[int]], list[list[int]], list[float], float]:
    messages = [[{"role": "user", "content": f"What is the capital of {c}? Answer in one word."}] for c in QUESTIONS]
    prompts = [llm.apply_chat_template(m) for m in messages]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    flat_prompts, completions, advantages, rewards = [], [], [], []
    for out, city in zip(outputs, QUESTIONS.values()):
        scores = [float(city.lower() in c.text.lower()) for c in out.outputs]
        mean = sum(scores) / len(scores)
        for c, score in zip(out.outputs, scores):
            flat_prompts.append(out.prompt_token_ids)
            completions.append(c.token_ids)
            advantages.append(score - mean)
        rewards += scores
    return flat_prompts, completions, advantages, sum(rewards) / len(rewards)


def push_weights(llm, trainer, bucket_bytes: int) -> None:
    """Bucket by bucket: the trainer broadcasts while every rank of the engine receives (both block until done)."""
    plan = ray.get(trainer.plan.remote(bucket_bytes))
    for i, (names, dtypes, shapes) in enumerate(plan):
        sent = trainer.send.remote(i)
        llm.update_weights_from_distributed(names, dtypes, shapes, GROUP, flush_cache=i == len(plan) - 1)
        ray.get(sent)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--tp", type=int, default=3, help="the engine's tensor-parallel size")
    parser.add_argument("--max-model-len", type=int, default=512, help="a prompt and its answer, in tokens")
    args = parser.parse_args(argv)

    from engine.connect import connect
    from engine.llm import LLM
    from engine.placement import SCHEDULER_CPUS
    from scheduler import SamplingParams

    connect(None, 1 + SCHEDULER_CPUS + args.tp)  # logical CPUs: the trainer, the engine's scheduler and its ranks
    # A KV cache the size these rollouts need (24 answers of ~64 tokens use ~25 MB a rank), not the CPU default of
    # 1 GiB a rank: waking it faults every page of it in again, seconds for 3 GiB once the trainer has run.
    kv_bytes = 128 << 20
    llm = LLM(
        args.model,
        tensor_parallel_size=args.tp,
        num_threads=1,
        max_model_len=args.max_model_len,
        kv_cache_bytes=kv_bytes,
        seed=0,
    )
    trainer = Trainer.remote(llm.engine.model_path, args.lr)
    port = _free_port()
    address, world_size = ray.get(trainer.address.remote()), 1 + args.tp
    joined = trainer.join.remote(address, port, world_size)
    llm.init_weights_update_group(address, port, 1, world_size, GROUP)
    ray.get(joined)
    params = SamplingParams(n=SAMPLES, temperature=0.8, max_tokens=24, seed=0)
    print(f"{'round':>5}{'reward':>8}{'generate s':>12}{'sleep s':>9}{'train s':>9}{'wake s':>8}{'update s':>10}")
    for round_ in range(1, args.rounds + 1):
        start = time.perf_counter()
        prompts, completions, advantages, reward = rollouts(llm, params)
        generate_s = time.perf_counter() - start
        start = time.perf_counter()
        llm.sleep(1)  # the KV cache back to the trainer while it steps
        sleep_s = time.perf_counter() - start
        start = time.perf_counter()
        ray.get(trainer.step.remote(prompts, completions, advantages))
        train_s = time.perf_counter() - start
        start = time.perf_counter()
        llm.wake_up(["weights"])
        wake_s = time.perf_counter() - start
        start = time.perf_counter()
        push_weights(llm, trainer, args.bucket_mb << 20)
        update_s = time.perf_counter() - start
        start = time.perf_counter()
        llm.wake_up(["kv_cache"])
        wake_s += time.perf_counter() - start
        print(
            f"{round_:>5}{reward:>8.3f}{generate_s:>12.2f}{sleep_s:>9.2f}{train_s:>9.2f}{wake_s:>8.2f}{update_s:>10.2f}"
        )
    llm.shutdown()


if __name__ == "__main__":
    main()
