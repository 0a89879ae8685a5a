"""The chat bench's llama.cpp system (celeris.bench.llamacpp) against a fake ``llama_cpp`` module: llama-cpp-python
is an optional extra, never installed in CI. The fake's ``Llama`` yields scripted token ids and records what it was
given: the prompt ids must reach it unchanged, the answer is cut at an end id or the length cap, one pass per
sampled token; a tiny GGUF model's chat bench runs it beside the engine, and leaves it out with a note."""

from __future__ import annotations

import sys
import types
from itertools import chain, repeat

import pytest
import torch

from celeris.bench import llamacpp

EOS = 7


class FakeLlama:
    """``llama_cpp.Llama``'s surface the bench uses; ``script(prompt)`` gives the (endless) ids it yields."""

    made: list[FakeLlama] = []
    default_script = staticmethod(lambda prompt: chain([5, 6, EOS], repeat(9)))

    def __init__(self, script=None, **kwargs) -> None:  # noqa: ANN001
        self.kwargs, self.script = kwargs, script or self.default_script
        self.prompts: list[list[int]] = []
        self.sampling: list[dict] = []
        self.events: list[str] = []
        self.pulled = 0  # tokens taken from the generators: each one a forward pass in llama.cpp
        FakeLlama.made.append(self)

    def token_eos(self) -> int:
        return self.kwargs.get("eos", EOS)

    def n_ctx(self) -> int:
        return self.kwargs.get("n_ctx", 64)

    def reset(self) -> None:
        self.events.append("reset")

    def generate(self, tokens, **sampling):  # noqa: ANN001, ANN201
        self.events.append("generate")
        self.prompts.append(tokens)
        self.sampling.append(sampling)
        for token in self.script(tokens):
            self.pulled += 1
            yield token


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    module = types.ModuleType("llama_cpp")
    module.Llama = FakeLlama
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    monkeypatch.setattr(FakeLlama, "made", [])
    return module


def test_prompt_ids_pass_unchanged_and_each_prompt_starts_from_an_empty_cache():
    llama = FakeLlama()
    prompts = [[1, 2, 3], [4, 2], [1, 2, 3]]
    ids, passes, ttft = llamacpp.generate(llama, prompts, max_tokens=8)
    assert llama.prompts == [[1, 2, 3], [4, 2], [1, 2, 3]] and prompts == [[1, 2, 3], [4, 2], [1, 2, 3]]
    assert llama.events == ["reset", "generate"] * 3  # no prefix of the previous prompt reused
    assert all(s["top_k"] == 1 and s["temp"] == 0.0 and s["repeat_penalty"] == 1.0 and s["frequency_penalty"] == 0
               and s["presence_penalty"] == 0 for s in llama.sampling)
    assert ids == [[5, 6]] * 3 and passes == [3] * 3  # the end id's pass counts, the id does not
    assert len(ttft) == 3 and 0 <= ttft[0] <= ttft[1] <= ttft[2]  # from the batch's start: one prompt after another


def test_the_answer_ends_before_the_eos_or_an_end_id_and_at_max_tokens():
    llama = FakeLlama(script=lambda p: chain([5, 11, 6], repeat(9)))
    assert llamacpp.generate(llama, [[1]], max_tokens=8, end_ids=[11])[:2] == ([[5]], [2])
    endless = FakeLlama(script=lambda p: repeat(9))
    ids, passes, _ = llamacpp.generate(endless, [[1], [2, 3]], max_tokens=4)
    assert ids == [[9] * 4] * 2 and passes == [4, 4] and endless.pulled == 8  # no pass past the cap
    first = FakeLlama(script=lambda p: chain([EOS], repeat(9)))
    assert llamacpp.generate(first, [[1]], max_tokens=4)[:2] == ([[]], [1])  # the prefill's pass alone


def test_the_models_penalties_reach_llama_cpp_under_its_names():
    llama = FakeLlama()
    llamacpp.generate(llama, [[1]], max_tokens=4, penalties={"repetition_penalty": 1.1, "frequency_penalty": 0.2,
                                                             "presence_penalty": 0.3})
    assert llama.sampling[0] | {"reset": True} == {"top_k": 1, "temp": 0.0, "repeat_penalty": 1.1,
                                                   "frequency_penalty": 0.2, "presence_penalty": 0.3, "reset": True}


def test_answers_fit_llama_cpps_context():
    llama = FakeLlama(script=lambda p: repeat(9), n_ctx=10)
    ids, passes, _ = llamacpp.generate(llama, [[1] * 8], max_tokens=5)
    assert ids == [[9, 9]] and passes == [2]
    with pytest.raises(ValueError, match="no room"):
        llamacpp.generate(llama, [[1] * 10], max_tokens=5)


def test_load_uses_torchs_threads_and_the_given_file(fake_llama_cpp, monkeypatch, tmp_path):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    llamacpp.load(tmp_path / "m.gguf", n_ctx=300)
    assert FakeLlama.made[0].kwargs == {"model_path": str(tmp_path / "m.gguf"), "n_ctx": 300, "n_threads": 3,
                                        "n_threads_batch": 3, "n_batch": 512, "verbose": False, "seed": 0,
                                        "last_n_tokens_size": 300}


def test_unavailable_without_the_module_or_a_gguf_file(fake_llama_cpp, monkeypatch, tmp_path):
    assert llamacpp.unavailable_reason(tmp_path / "m.gguf") is None
    assert "not loaded from a .gguf" in llamacpp.unavailable_reason(None)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    assert "pip install llama-cpp-python" in llamacpp.unavailable_reason(tmp_path / "m.gguf")


@pytest.fixture
def tiny_gguf_chat(tmp_path, monkeypatch):
    """A tiny Llama GGUF (ChatML template) and three short mt-bench prompts."""
    import celeris.bench.chat
    from tests.models.conftest_gguf import tiny_checkpoint, write_gguf

    monkeypatch.setenv("CELERIS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(celeris.bench.chat.PROMPT_SETS, "mt-bench", lambda: ["a b", "c d e", "the f"])
    return write_gguf(tmp_path / "tiny-llama.gguf", tiny_checkpoint("llama"))


def test_the_chat_bench_runs_llama_cpp_on_the_same_gguf_and_prompt_ids(tiny_gguf_chat, fake_llama_cpp, monkeypatch,
                                                                        tmp_path):
    from celeris.bench.chat import ChatBenchConfig, run_chat_bench
    from celeris.llm import LLM
    from celeris.reference.autoregressive import generate_autoregressive
    from celeris.sampling.params import SamplingParams

    llm = LLM(str(tiny_gguf_chat))
    assert llm.gguf_path == tiny_gguf_chat
    eos = llm.tokenizer.eos_token_id
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in ["a b", "c d e", "the f"]]
    ref = [generate_autoregressive(llm.model, [p], SamplingParams(max_tokens=6)).token_ids[0] for p in prompts]
    assert len(ref[0]) == len(ref[1]) == 6  # the tiny model's greedy answers run to the cap
    other = (ref[1][3] + 1) % eos
    answers = {  # the engine's own answer; one that leaves it at position 3; a short one that ends at the eos
        tuple(prompts[0]): (lambda: chain(ref[0], repeat(3)), ref[0]),
        tuple(prompts[1]): (lambda: chain(ref[1][:3], repeat(other)), ref[1][:3] + [other] * 3),
        tuple(prompts[2]): (lambda: chain(prompts[2][-2:], [eos], repeat(3)), prompts[2][-2:])}
    monkeypatch.setattr(FakeLlama, "default_script", staticmethod(lambda prompt: answers[tuple(prompt)][0]()))
    cfg = ChatBenchConfig(
        own_process_memory=False, model=str(tiny_gguf_chat), prompt_sets=["mt-bench"], max_tokens=6, batch_sizes=[1, 2],
                          num_prompts=3, warmup=0, out_dir=str(tmp_path / "out"), smollm2=False)
    results = run_chat_bench(cfg)
    assert [(r["system"], r["batch_size"]) for r in results["runs"]] == [
        (n, b) for b in (1, 2) for n in ("target-next-token", "target-lookup", "llama.cpp")]
    (llama,) = FakeLlama.made
    assert llama.kwargs["model_path"] == str(tiny_gguf_chat) and llama.kwargs["n_threads"] == torch.get_num_threads()
    assert llama.kwargs["n_ctx"] == max(map(len, prompts)) + 6
    assert llama.prompts == prompts * 2  # the engine's own prompt ids, once per batch size
    by = {(r["system"], r["batch_size"]): r for r in results["runs"]}
    for b in (1, 2):
        run = by[("llama.cpp", b)]
        assert by[("target-next-token", b)]["outputs"] == ref
        assert set(by[("target-lookup", b)]) <= set(run) and "one after another" in run["note"]
        assert run["outputs"] == [answers[tuple(p)][1] for p in prompts] and run["output_tokens"] == 14
        assert run["tokens_per_forward"] == round(14 / 15, 3) and run["nfe_mean"] == 5.0  # passes: 6, 6, 2 + the eos's
        second, third = run["mismatches"][0], run["mismatches"][1]
        assert len(run["mismatches"]) == 2 and (second["prompt"], second["position"]) == (1, 3)
        assert third["prompt"] == 2 and third["position"] == next(
            (j for j, (a, c) in enumerate(zip(prompts[2][-2:], ref[2], strict=False)) if a != c), 2)
    assert not any("llama.cpp" in n for n in results["notes"])


def test_the_chat_bench_leaves_llama_cpp_out_with_a_note(tiny_gguf_chat, fake_llama_cpp, monkeypatch, tmp_path,
                                                          capsys):
    from celeris.bench.chat import ChatBenchConfig, run_chat_bench
    from celeris.cli import main

    rc = main(["bench", "--model", str(tiny_gguf_chat), "--prompt-set", "mt-bench", "--lengths", "4",
               "--num-prompts", "1", "--warmup", "0", "--no-smollm2", "--no-llamacpp", "--out", str(tmp_path / "a")])
    out = capsys.readouterr().out
    assert rc == 0 and "note: llama.cpp left out (--no-llamacpp)" in out and "llama.cpp " not in out.split("note:")[0]
    assert FakeLlama.made == []
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not installed
    cfg = ChatBenchConfig(
        own_process_memory=False, model=str(tiny_gguf_chat), prompt_sets=["mt-bench"], max_tokens=4, batch_sizes=[1],
                          num_prompts=1, warmup=0, out_dir=str(tmp_path / "b"), smollm2=False)
    results = run_chat_bench(cfg)
    assert [r["system"] for r in results["runs"]] == ["target-next-token", "target-lookup"]
    assert [n for n in results["notes"] if "llama" in n] == [
        n for n in results["notes"] if n.startswith("llama.cpp skipped: llama_cpp does not import")] != []
