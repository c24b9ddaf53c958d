"""`raylm generate`: one prompt through the offline engine."""

from __future__ import annotations

import argparse

from engine.cli_flags import add_engine_flags, llm_kwargs


def add_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, help="this request's seed (the engine's --seed elsewhere)")
    add_engine_flags(gen, exclude=("seed",))
    gen.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from engine.llm import LLM
    from scheduler import SamplingParams

    llm = LLM(**llm_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    print(out.outputs[0].text)
