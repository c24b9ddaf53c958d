"""`raylm bench ...`: one module of bench/ per command, owning its flags (`add_cli_args`) and its `main`. Its module
is imported when the command line names it, not before: `raylm --help` and `raylm bench --help` load no benchmark,
torch or Ray."""

from __future__ import annotations

import argparse
import importlib

# command: its module in bench/, and its line in `raylm bench --help`
BENCHES = {
    "scheduler": ("scheduler", "scheduler decode-step time with no model"),
    "throughput": ("throughput", "offline throughput, against transformers static batching"),
    "profile": (
        "profile",
        "torch.profiler on decode steps of an in-process engine: kernels (CPU: top-level ops) per step, busy and idle "
        "time per step, the top kernels, one layer's kernels",
    ),
    "prefix-reuse": (
        "prefix_reuse",
        "long-document QA: prefix caching off, on, and with the host tier (sizes the device pool to a quarter of the "
        "documents, the host tier to all; CPU)",
    ),
    "structured": ("structured", "structured outputs: JSON-schema validity, and cost against free text"),
    "ray-overhead": ("ray_overhead", "round trip of an empty step to every rank, three ways"),
    "engine-steps": ("engine_steps", "engine steps/s with the no-work model: serial vs async scheduling"),
    "moe": ("moe", "one MoE layer per token: the fused expert op against a per-expert loop"),
    "lora": ("lora", "output tok/s of batches mixing LoRA adapters, against the base model and a per-adapter loop"),
    "fp8": (
        "fp8",
        "a model as it is, with FP8 weights and with an FP8 KV cache: throughput, decode steps, KV blocks",
    ),
    "pipeline": (
        "pipeline",
        "pp=1 vs pp=2 (1 thread per rank), 1 vs P steps in flight: tok/s, stage busy, transfers",
    ),
    "embed": ("embed", "embeddings/s of the pooling path against transformers, same inputs"),
    "soak": (
        "soak",
        "a fixed-rate mix (streams, n>1, stop, logprobs, bad requests, disconnects) against its own raylm serve: 5xx, "
        "p99 over time, memory, leaks",
    ),
    "serve": ("serving", "online serving over HTTP streaming: TTFT, TPOT, ITL, latency, throughput"),
    "pd": (
        "pd",
        "prefill/decode disaggregation against unified, same ranks: long prompts at a steady rate beside streaming "
        "decodes; ITL, TTFT, output tok/s, KV moved",
    ),
    "kv-transfer": (
        "kv_transfer",
        "a prompt's KV from a prefill engine to a decode engine, against the object store's copy",
    ),
    "weight-sync": (
        "weight_sync",
        "RL between rollouts: the whole model pushed from a trainer to tp=1 and tp=3 engines against a memcpy of its "
        "bytes, sleep and wake, and the engine's start an update spares",
    ),
    "spec": (
        "spec",
        "speculative decoding against none (n-gram, or --speculative-config's; with a draft model, n-gram and the "
        "draft): copy-heavy and chat workloads, TPOT, tok/s, acceptance",
    ),
}


class _BenchCommands(argparse._SubParsersAction):
    """The bench subcommands; the one named gets its module's flags and `main` as it is parsed."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        command = self._name_parser_map.get(values[0])
        if command is not None and command.get_default("run") is None:
            module = importlib.import_module(f"bench.{BENCHES[values[0]][0]}")
            module.add_cli_args(command)
            command.set_defaults(run=module.main)
        super().__call__(parser, namespace, values, option_string)


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks that print figures")
    # type(bench): the top parser's class, which takes no flag for a prefix of another.
    commands = bench.add_subparsers(dest="bench", required=True, parser_class=type(bench), action=_BenchCommands)
    for name, (_, help_text) in BENCHES.items():
        commands.add_parser(name, help=help_text)
