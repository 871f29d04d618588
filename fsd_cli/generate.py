"""``fsd generate``: one prompt through the FSD engine; prints the text, then acceptance and speed stats."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("generate", help="generate text with fuzzy speculative decoding")
    parser.add_argument("prompt", help="the user message (sent through the chat template unless --raw)")
    parser.add_argument("--pair", default="smollm2-135m", help="registered pair name (see `fsd models list`; tiny = random test pair) or 'target,draft' paths")
    parser.add_argument("--threshold", "-T", type=float, default=0.0, help="fuzzy threshold T (0 = exact SD)")
    parser.add_argument("--div", default="kl", help="divergence: kl, reverse_kl, js, tv, draft_tokens")
    parser.add_argument("--rule", default="reducible", help="acceptance rule: reducible or pure")
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=4, help="draft tokens per iteration")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--greedy", action="store_true", help="temperature 0")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--raw", action="store_true", help="no chat template: the prompt is plain text")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text + stats")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from decoder.engine import SamplingParams
    from decoder.generate import generate_text
    from decoder.pairs import find_pair_spec, load_pair

    params = SamplingParams(
        temperature=0.0 if args.greedy else args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        stop=tuple(args.stop),
        seed=args.seed,
    )
    params.validate()  # fail on bad flags before spending ~20 s loading a model
    spec = find_pair_spec(args.pair)
    if spec is not None and spec.torch_threads is not None:
        torch.set_num_threads(spec.torch_threads)
    pair = load_pair(args.pair)
    with torch.inference_mode():
        result = generate_text(
            pair,
            args.prompt,
            threshold=args.threshold,
            div=args.div,
            rule=args.rule,
            num_draft_tokens=args.num_draft_tokens,
            params=params,
            chat=not args.raw,
        )
    out = result.output
    stats = {
        "pair": pair.name,
        "threshold": args.threshold,
        "div": args.div,
        "rule": args.rule,
        "k": args.num_draft_tokens,
        "tokens": len(out.token_ids),
        "finish_reason": out.finish_reason,
        "iterations": out.iterations,
        "acceptance_rate": round(out.acceptance_rate, 4),
        "tokens_per_iteration": round(out.tokens_per_iteration, 3),
        "fuzzy_accepted": out.fuzzy_accepted,
        "mean_distortion": round(out.mean_distortion, 5),
        "prefill_s": round(result.prefill_time_s, 3),
        "decode_s": round(result.decode_time_s, 3),
        "tokens_per_s": round(result.tokens_per_second, 2),
    }
    if args.json:
        print(json.dumps({"text": result.text, **stats}))
        return 0
    print(result.text)
    print(
        f"\n[{stats['tokens']} tokens, {stats['finish_reason']}] acceptance {stats['acceptance_rate']:.2f} "
        f"({out.accepted}/{out.drafted}, fuzzy {out.fuzzy_accepted}), {stats['tokens_per_iteration']:.2f} "
        f"tokens/iteration, mean distortion {stats['mean_distortion']:.4f}, {stats['tokens_per_s']:.1f} tokens/s "
        f"(prefill {stats['prefill_s']:.2f} s)"
    )
    return 0
