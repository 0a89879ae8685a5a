"""lm-evaluation-harness against `celeris serve` (slow tier; needs the ``celeris[eval]`` extra): its
``local-completions`` model on the two shipped tasks (``celeris/data/lm_eval``), loaded with ``--include_path``,
``HF_DATASETS_OFFLINE=1`` and no ``tokenizer=`` (the server's /tokenizer_info, /tokenize and /detokenize are
detected). Every per-sample loglikelihood must equal Celeris's own scoring through ``LLM`` (``prompt_logprobs``)
within 1e-4, and every generation ``LLM.generate``'s with the same seed; the harness's scores themselves are not
checked (a weak model scoring 0 is no failure, a mismatch is)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from celeris.models.catalog import ALIASES, package_dir
from celeris.serve.app import BackgroundServer, create_app
from celeris.serve.serving import OpenAIServing

pytestmark = pytest.mark.slow
TASKS = Path(__file__).resolve().parents[2] / "celeris" / "data" / "lm_eval"
LIMIT = 8  # questions per task (the tasks hold 40)
SEED = 1234  # lm-evaluation-harness's default seed, sent with every request


def run_harness(url: str, model: str, out: Path) -> dict[str, list[dict]]:
    """Run ``lm_eval`` as a user would (the docs' command) and return its logged samples per task."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    args = f"base_url={url}/v1/completions,model={model},num_concurrent=1,max_retries=1,max_length=512,seed={SEED}"
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
           "--include_path", str(TASKS), "--tasks", "celeris_gsm8k_choice,celeris_gsm8k_gen", "--limit", str(LIMIT),
           "--output_path", str(out), "--log_samples"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    samples = {}
    for task in ("celeris_gsm8k_choice", "celeris_gsm8k_gen"):
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return samples


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's ``_encode_pair`` (trailing spaces move to the continuation; the whole text is
    encoded, then split), with the server's tokenizer as its remote backend calls it (no special tokens)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def check_against_llm(serving: OpenAIServing, samples: dict[str, list[dict]]) -> None:
    llm, tok = serving.llm, serving.tokenizer
    choice = samples["celeris_gsm8k_choice"]
    assert len(choice) == LIMIT
    for sample in choice:
        for i, resp in enumerate(sample["resps"]):
            args = sample["arguments"][f"gen_args_{i}"]
            ctx, cont = encode_pair(tok, args["arg_0"], args["arg_1"])
            scored = llm.generate([ctx + cont], llm.default_params(max_tokens=1, prompt_logprobs=0, seed=SEED))[0]
            ours = sum(e.logprob for e in scored.prompt_logprobs[len(ctx):])
            assert float(resp[0][0]) == pytest.approx(ours, abs=1e-4), (sample["doc_id"], i)
    gen = samples["celeris_gsm8k_gen"]
    assert len(gen) == LIMIT
    eos = tok.decode([tok.eos_token_id], skip_special_tokens=False)
    for sample in gen:
        args = sample["arguments"]["gen_args_0"]
        kwargs = args["arg_1"] if isinstance(args["arg_1"], dict) else ast.literal_eval(args["arg_1"])
        ids = tok.encode(args["arg_0"], add_special_tokens=False)
        params = llm.default_params(max_tokens=kwargs["max_gen_toks"], temperature=0.0, seed=SEED,
                                    stop=[*kwargs["until"], eos])
        ours = llm.generate([ids], params)[0].text
        for stop in [*kwargs["until"], eos]:  # the harness cuts at its stop strings again
            ours = ours.split(stop)[0]
        assert sample["resps"][0][0] == ours, sample["doc_id"]


@pytest.mark.parametrize("model", ["celeris-code-6m-ar", "smollm2-135m-instruct"])
def test_harness_scores_equal_celeris_own(model, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install -e '.[eval]')")
    if model in ALIASES:
        folder = package_dir(ALIASES[model].package)
        if not (folder and sorted(folder.glob("*.gguf"))):
            pytest.skip(f"SmolLM2-135M-Instruct is not installed ({ALIASES[model].install})")
        monkeypatch.setenv("CELERIS_CACHE", str(tmp_path / "cache"))
    serving = OpenAIServing.from_model(model, device="cpu", max_num_seqs=2, request_timeout=300)
    with BackgroundServer(create_app(serving)) as srv:
        samples = run_harness(srv.url, serving.model_name, tmp_path / "out")
    check_against_llm(serving, samples)  # the server is stopped: the LLM's engine has one caller again
