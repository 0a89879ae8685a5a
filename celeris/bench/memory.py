"""Peak resident memory of each benched system in a process of its own (``celeris bench``; issue 48).

The chat bench runs every system in one process, so its ``peak_rss_mb`` counts every model loaded together. Here
each system loads alone in a fresh Python process: Celeris (``python -m celeris.bench.memory``) with its model's
own settings (``default``: the model as it loads, drafter and all; ``target-next-token``: the same load decoding
token by token), or llama.cpp on the same ``.gguf`` file (``LLAMA_CHILD``: llama_cpp alone, with the bench's
threads, greedy, the model's penalties), answers the given prompts at batch 1, and prints its process's peak RSS
(``VmHWM``, else ``ru_maxrss``) as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from celeris.bench.run import next_token_params, peak_rss_mb
from celeris.llm import LLM

CELERIS_SYSTEMS = ("default", "target-next-token")  # what this module's child (``main``) runs
# llama.cpp twice: with the context the prompts need, and with Celeris's own context (``LLM.context_length``, the
# n_ctx issue 48 compares at: llama.cpp allocates its whole KV cache up front, Celeris's store touches only the
# positions requests hold)
LLAMA_SYSTEMS = ("llama.cpp", "llama.cpp-full-context")
SYSTEMS = (*CELERIS_SYSTEMS, *LLAMA_SYSTEMS)
# llama.cpp's child imports llama_cpp alone (not Celeris, which imports PyTorch: 200-odd MB of its own)
LLAMA_CHILD = """
import json, resource, sys
import llama_cpp
job = json.loads(sys.stdin.read())
n_ctx = job.get("n_ctx") or max(map(len, job["prompts"])) + job["max_tokens"]
llama = llama_cpp.Llama(model_path=job["gguf"], n_ctx=n_ctx, n_threads=job["threads"], n_threads_batch=job["threads"],
                        n_batch=512, verbose=False, seed=0, last_n_tokens_size=n_ctx)
stop, tokens = {llama.token_eos(), *job["end_ids"]}, 0
for prompt in job["prompts"]:
    llama.reset()
    for n, token in enumerate(llama.generate(prompt, top_k=1, temp=0.0, reset=True, **job["penalties"])):
        if token in stop or n == job["max_tokens"]:
            break
        tokens += 1
peak = next((int(x.split()[1]) / 1024 for x in open("/proc/self/status") if x.startswith("VmHWM:")),
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
print(json.dumps({"peak_rss_mb": round(peak, 1), "output_tokens": tokens, "n_ctx": n_ctx}))
"""


def own_process_memory(llm: LLM, options: dict, prompts: list[list[int]], max_tokens: int,
                       with_llamacpp: bool) -> dict:
    """``own_process_rss`` of ``default``, ``target-next-token`` and (``with_llamacpp``) ``llama.cpp`` on
    ``llm``'s ``.gguf`` file with ``llm``'s penalties and end ids, at the bench's threads, with the context the
    prompts need and with ``llm``'s context length (``llama.cpp-full-context``): system -> result."""
    base = llm.default_params()
    llama = {"gguf": str(llm.gguf_path), "end_ids": sorted(llm.end_token_ids),
             "penalties": {"repeat_penalty": base.repetition_penalty, "frequency_penalty": base.frequency_penalty,
                           "presence_penalty": base.presence_penalty}}
    names = [n for n in SYSTEMS if n not in LLAMA_SYSTEMS or with_llamacpp]
    contexts = {"llama.cpp-full-context": llm.context_length}
    return {n: own_process_rss(n, options, prompts, max_tokens, torch.get_num_threads(),
                               {**llama, "n_ctx": contexts.get(n)}) for n in names}


def own_process_rss(system: str, options: dict, prompts: list[list[int]], max_tokens: int, threads: int,
                    llama: dict | None = None, timeout_s: float = 600.0) -> dict:
    """Run ``system`` alone in a child process: ``{"peak_rss_mb", "output_tokens"}``, or ``{"error"}`` with the
    child's last line when it failed or ran out of time.

    Args:
        options: the ``LLM`` keyword arguments (``model`` among them) the bench loaded its model with.
        prompts: prompt ids, answered one after another.
        llama: for ``llama.cpp``: ``{"gguf": path, "end_ids": [...], "penalties": {llama.cpp's names: values}}``.
    """
    if system in LLAMA_SYSTEMS:
        command = [sys.executable, "-c", LLAMA_CHILD]
        job = json.dumps({**(llama or {}), "prompts": prompts, "max_tokens": max_tokens, "threads": threads})
    else:
        command = [sys.executable, "-m", "celeris.bench.memory"]
        job = json.dumps({"system": system, "options": options, "prompts": prompts, "max_tokens": max_tokens,
                          "threads": threads})
    try:
        done = subprocess.run(command, input=job, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer within {timeout_s:.0f} s"}
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"exit {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def run(job: dict) -> dict:
    """The child's work: load ``job["system"]`` alone, answer ``job["prompts"]``, report the peak RSS."""
    torch.set_num_threads(job["threads"])
    options = dict(job["options"])
    llm = LLM(options.pop("model"), **options)
    params = llm.default_params(max_tokens=job["max_tokens"], temperature=0.0)
    if job["system"] == "target-next-token":
        params = next_token_params(params)
    outs = [llm.generate([p], params)[0] for p in job["prompts"]]
    return {"peak_rss_mb": round(peak_rss_mb(), 1), "output_tokens": sum(len(o.token_ids) for o in outs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args()
    job = json.loads(sys.stdin.read())
    if job.get("system") not in CELERIS_SYSTEMS:
        raise SystemExit(f"unknown Celeris system {job.get('system')!r} (known: {', '.join(CELERIS_SYSTEMS)})")
    print(json.dumps(run(job)), flush=True)


if __name__ == "__main__":
    main()
