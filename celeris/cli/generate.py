"""`celeris generate`, `celeris chat` and `celeris eval humaneval`: one model, the sampling flags."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from celeris.cli.common import (
    _load,
    _sampling_args,
    _tokenizer_overrides,
)
from celeris.data import existing


def add_parsers(sub) -> None:  # noqa: ANN001 - argparse's subparsers action
    """`celeris generate`, `chat` and `eval`."""
    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("prompt")
    _sampling_args(g)
    g.add_argument("--suffix", help="text after the gap: fill the span between prompt and suffix")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--show-denoising", action="store_true", help="redraw the answer after every step")
    g.add_argument("--raw", action="store_true", help="send the prompt as it is, without the chat template a chat "
                   "model's generate applies (the default model's; Ollama's raw)")

    c = sub.add_parser("chat", help="interactive chat loop (uses the chat template; the embedded code models "
                                    "answer in '#' comment lines: use generate for code)")
    _sampling_args(c)
    ev = sub.add_parser("eval", help="quality check: HumanEval prompts, ast.parse rate, repetition")
    ev.add_argument("suite", choices=["humaneval"])
    _sampling_args(ev)
    ev.add_argument("--data", help="HumanEval JSONL(.gz) file (default: the HumanEval set shipped in celeris/data)")
    ev.add_argument("--limit", type=int, help="first N problems only")
    ev.add_argument("--out", help="write the full results as JSON here")


def cmd_generate(args: argparse.Namespace) -> int:
    from celeris.text import render_canvas

    start = time.perf_counter()
    llm, params = _load(args)
    on_step = None
    if args.show_denoising:
        mask_id, tty = llm.model.config.mask_token_id, sys.stdout.isatty()
        counter = {"step": 0}

        def on_step(answer):  # noqa: ANN001
            counter["step"] += 1
            text = render_canvas(llm.tokenizer.decode, answer[0].tolist(), mask_id, llm.tokenizer.eos_token_id)
            prefix = "\x1b[2J\x1b[H" if tty else f"--- step {counter['step']} ---\n"
            print(f"{prefix}{'' if chat else args.prompt}{text}", flush=True)

    chat = llm.chat_by_default and not args.raw and not args.suffix  # one user turn through the chat template
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}]) if chat else args.prompt
    out = llm.generate([prompt], params, suffixes=[args.suffix], on_step=on_step)[0]
    if out.finish_reason == "error":
        print(f"celeris: error: {out.error_code}: {out.error}", file=sys.stderr)
        return 1
    if args.json:
        record = {"prompt": args.prompt, "text": out.text, "token_ids": out.token_ids, "nfe": out.nfe,
                  "seconds": round(out.seconds, 4), "ttft_s": out.ttft_s and round(out.ttft_s, 4),
                  "finish_reason": out.finish_reason, "total_seconds": round(time.perf_counter() - start, 4),
                  "steps": out.steps, "tokens_per_forward": round(out.num_committed / out.nfe, 4) if out.nfe else 0.0,
                  "block_length": min(params.block_length, params.max_tokens), "cache": params.cache,
                  "decoding": params.decoding, "remasking": params.remasking}
        print(json.dumps(record))
    elif args.suffix:
        print(f"{args.prompt}{out.text}{args.suffix}")
    else:
        print(out.text if chat else f"{args.prompt}{out.text}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from jinja2 import TemplateError

    llm, params = _load(args)
    messages: list[dict[str, str]] = []
    print("celeris chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        try:
            prompt_ids = llm.tokenizer.encode_chat(messages, add_generation_prompt=True)  # contents stay text
            answer = llm.generate([prompt_ids], params)[0].text
        except (ValueError, TemplateError) as exc:  # the conversation outgrew the context, the template refused it
            print(f"celeris: error: {exc}", file=sys.stderr)
            messages.pop()
            continue
        print(f"model> {answer}")
        messages.append({"role": "assistant", "content": answer})
    return 0




def cmd_eval(args: argparse.Namespace) -> int:
    from celeris.bench.quality import evaluate_humaneval, load_humaneval

    _tokenizer_overrides(args)  # a missing file is named before the data loads
    data = existing(args.data, "a HumanEval JSONL(.gz) file", "--data") if args.data else None
    problems = load_humaneval(data)[: args.limit]
    llm, params = _load(args)
    report = evaluate_humaneval(llm, params, problems)
    if args.out:
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(args.out)
    print(json.dumps({k: v for k, v in report.items() if k != "results"}))
    return 0
