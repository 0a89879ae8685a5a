"""What a penalty setting does to the default's answers and to its drafts' acceptance, without timing anything.

Two measurements, each per setting (``name=value``: ``frequency_penalty=0.2``, ``repetition_penalty=1.1``, ...; the
default's own value is overridden, so ``frequency_penalty=0`` measures the default without its penalty):

- ``writing``: thirteen open-ended writing requests of our own (not a bench set: an email, a story, a recipe, a
  poem, ...), greedy, 256 tokens, one batch: how many answers end by themselves before the length cap, how many
  hold a run of one token longer than 8 (the bench's repetition share), how many repeat a line 3 times or more,
  the answers' distinct-2 and mean length;
  the answers go to ``--out`` (``penalty-<setting>.json``) to be read;
- ``acceptance``: the bench's first 8 MT-Bench and GSM8K prompts through the chat template, 128 tokens, one prompt
  at a time (batch 1, where the default drafts): tokens per target pass (answer tokens / the target's forward
  passes; counts, not seconds, so load on the machine does not change them, though the thread count can by a few
  near-ties: 1.280 / 2.179 at 2 threads, 1.282 / 2.184 at 1 for frequency 0.2) and the same quality counts.

    PYTHONPATH=. python scripts/penalty_probe.py frequency_penalty=0,frequency_penalty=0.2 --threads 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from celeris import LLM
from celeris.bench.chat import PROMPT_SETS, distinct_2
from celeris.bench.quality import max_repeat_run

WRITING = [
    "Write a short email inviting the team to a demo on Friday.",
    "Write a short story about a cat who learns to swim.",
    "Describe your ideal weekend in a few sentences.",
    "Write a thank-you note to a teacher.",
    "Explain why the sky is blue to a child.",
    "Write a product description for a reusable water bottle.",
    "Give me a recipe for a simple tomato soup.",
    "Write a poem about autumn leaves.",
    "Write a cover letter opening paragraph for a junior developer job.",
    "What are the pros and cons of working from home?",
    "Write an announcement that the office will be closed on Monday.",
    "Tell me about the history of the bicycle.",
    "Write a short poem about the ocean.",  # looped on the fast pass (issue 48's closing notes)
]


def repeats_a_line(text: str, times: int = 3) -> bool:
    """Whether some line of ``text`` with three words or more occurs ``times`` times or more (a loop of lines, as
    "Abe aria, aria of the sea." line after line, which no run of one token shows)."""
    lines = [x.strip() for x in text.splitlines() if len(x.split()) >= 3]
    return any(lines.count(x) >= times for x in set(lines))


def quality(ids: list[list[int]], max_tokens: int, texts: list[str] | None = None) -> dict:
    """Counts over answers (token ids each): ended before ``max_tokens``, looping (a run of one token > 8), line
    loops (``repeats_a_line``, given the texts), distinct-2, mean length."""
    lines = {} if texts is None else {"line_loops": sum(map(repeats_a_line, texts))}
    return {"ended": sum(len(i) < max_tokens for i in ids), "looping": sum(max_repeat_run(i) > 8 for i in ids),
            **lines, "distinct_2": distinct_2(ids), "mean_tokens": round(sum(map(len, ids)) / len(ids), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", help="comma-separated name=value penalty settings")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/penalty-probe", help="folder for the writing answers")
    parser.add_argument("--skip", choices=["writing", "acceptance"], help="leave one measurement out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM()
    for setting in args.settings.split(","):
        name, value = setting.split("=")
        if args.skip != "writing":
            params = llm.default_params(max_tokens=256, **{name: float(value)})
            answers = llm.generate([llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in WRITING],
                                   params)
            record = {"setting": setting, "measure": "writing",
                      **quality([a.token_ids for a in answers], 256, [a.text for a in answers])}
            print(json.dumps(record), flush=True)
            (out / f"penalty-{setting}.json").write_text(json.dumps({**record, "texts": [a.text for a in answers]},
                                                                    indent=1))
        if args.skip != "acceptance":
            params = llm.default_params(max_tokens=128, **{name: float(value)})
            for set_name in ("mt-bench", "gsm8k"):
                prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": t}])
                           for t in PROMPT_SETS[set_name]()[:8]]
                answers = [llm.generate([p], params)[0] for p in prompts]
                tokens, passes = sum(len(a.token_ids) for a in answers), sum(a.nfe for a in answers)
                print(json.dumps({"setting": setting, "measure": "acceptance", "set": set_name,
                                  "tokens_per_pass": round(tokens / passes, 3),
                                  **quality([a.token_ids for a in answers], 128)}), flush=True)


if __name__ == "__main__":
    main()
