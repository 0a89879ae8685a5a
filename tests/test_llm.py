"""The LLM facade on a tiny checkpoint folder with a real (tiny) BPE tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from celeris.llm import LLM, RequestOutput
from celeris.models.loader import CheckpointError
from celeris.reference.masked import generate
from celeris.sampling.params import SamplingParams

PROMPTS = ["def fibonacci(n):", "import os", "class Stack:\n    def push(self, item):\n"]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint, device="cpu")


def params(**kw):
    return SamplingParams(**{"max_tokens": 16, "steps": 16, "block_length": 8, **kw})


def test_loads_tokenizer_and_defaults(llm):
    tok = llm.tokenizer
    cfg = llm.model.config
    assert (tok.eos_token_id, tok.mask_token_id, tok.pad_token_id) == (
        cfg.eos_token_id, cfg.mask_token_id, cfg.pad_token_id)
    assert tok.vocab_size == cfg.vocab_size
    assert llm.context_length == 64
    d = llm.default_params()
    assert (d.max_tokens, d.steps, d.block_length) == (16, 16, 8)
    assert llm.default_params(steps=4).steps == 4


def test_generate_returns_request_outputs(llm):
    outs = llm.generate(PROMPTS, params())
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert isinstance(out, RequestOutput)
        assert out.prompt == prompt
        assert isinstance(out.text, str) and out.text
        assert out.token_ids and all(isinstance(t, int) for t in out.token_ids)
        assert len(out.token_ids) <= 16
        assert llm.tokenizer.eos_token_id not in out.token_ids
        assert llm.tokenizer.mask_token_id not in out.token_ids
        assert out.text == llm.tokenizer.decode(out.token_ids)
        assert out.finish_reason in ("stop", "length")
        assert out.nfe >= 1
        assert out.seconds > 0
        assert out.ttft_s is None or 0 <= out.ttft_s <= out.seconds
        if out.finish_reason == "length":
            assert len(out.token_ids) == 16
            assert out.nfe == 16  # fixed decoding: one forward per step, no early exit


def test_single_prompt_string(llm):
    outs = llm.generate("def add(a, b):", params())
    assert len(outs) == 1 and outs[0].prompt == "def add(a, b):"


def test_matches_sampler_and_batching_does_not_change_answers(llm):
    p = params(early_exit=False)
    batched = llm.generate(PROMPTS, p)
    for prompt, out in zip(PROMPTS, batched, strict=True):
        alone = llm.generate(prompt, p)[0]
        assert alone.token_ids == out.token_ids
        assert alone.text == out.text
        direct = generate(llm.model, [llm.tokenizer.encode(prompt)], p)
        assert direct.token_ids[0] == out.token_ids


def test_seeded_sampling_reproducible(llm):
    """The same seed gives the same tokens; sampling really samples: other seeds give other answers than
    greedy decoding (a sampler that ignored temperature would give greedy's tokens for every seed)."""
    a = llm.generate(PROMPTS[0], params(temperature=1.0, seed=3))[0]
    b = llm.generate(PROMPTS[0], params(temperature=1.0, seed=3))[0]
    assert a.token_ids == b.token_ids
    greedy = llm.generate(PROMPTS[0], params(temperature=0.0))[0].token_ids
    sampled = {tuple(llm.generate(PROMPTS[0], params(temperature=1.0, seed=s))[0].token_ids) for s in range(4)}
    assert len(sampled) > 1 and sampled != {tuple(greedy)}


def _stop_candidate(text: str) -> str | None:
    """A 2-character piece of ``text`` whose first occurrence is not at the start."""
    for i in range(2, len(text) - 1):
        piece = text[i : i + 2]
        if text.find(piece) >= 2 and piece.strip():
            return piece
    return None


@pytest.mark.parametrize("as_list", [False, True])
def test_stop_string_cuts_text(llm, as_list):
    prompt = PROMPTS[2]
    full = llm.generate(prompt, params(max_tokens=24, steps=24))[0]
    stop = _stop_candidate(full.text)
    assert stop is not None, f"tiny model text too uniform for a stop-string test: {full.text!r}"
    cut = full.text.find(stop)
    out = llm.generate(prompt, params(max_tokens=24, steps=24, stop=[stop, "never-there"] if as_list else stop))[0]
    assert out.text == full.text[:cut]
    assert stop not in out.text
    assert out.finish_reason == "stop"
    assert len(out.token_ids) < len(full.token_ids)
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert full.text[:cut].startswith(llm.tokenizer.decode(out.token_ids))


def test_earliest_stop_string_wins(llm):
    full = llm.generate(PROMPTS[0], params(max_tokens=24, steps=24))[0]
    assert len(full.text) >= 6
    late, early = full.text[-2:], full.text[1:3]
    out = llm.generate(PROMPTS[0], params(max_tokens=24, steps=24, stop=[late, early]))[0]
    assert out.text == full.text[: min(full.text.find(late), full.text.find(early))]
    assert out.finish_reason == "stop"


def test_stop_string_absent_keeps_length(llm):
    out = llm.generate(PROMPTS[1], params(stop=["\x00never\x00"]))[0]
    ref = llm.generate(PROMPTS[1], params())[0]
    assert out.text == ref.text and out.finish_reason == ref.finish_reason


def test_context_window_overflow_names_both_numbers(llm):
    prompt = "def fibonacci(n):\n" * 6
    n_prompt = len(llm.tokenizer.encode(prompt))
    p = params(max_tokens=40, steps=8)
    need = n_prompt + 40
    assert need > 64
    with pytest.raises(ValueError) as info:
        llm.generate(prompt, p)
    message = str(info.value)
    assert str(need) in message and "64" in message
    # exactly at the limit is fine
    fits = params(max_tokens=64 - n_prompt, steps=4, block_length=64 - n_prompt)
    assert llm.generate(prompt, fits)[0].nfe >= 1


def test_empty_prompt_rejected(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", params())
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["ok", ""], params())


def test_infilling_with_suffix(llm):
    p = params(max_tokens=8, steps=8, block_length=8, early_exit=False)
    a = llm.generate(["def f(x):\n"], p, suffixes=["    return y\n"])[0]
    b = llm.generate(["def f(x):\n"], p, suffixes=["class Stack:\n    pass\n"])[0]
    assert a.token_ids != b.token_ids  # the suffix is part of the context


def test_on_step_callback(llm):
    seen = []
    llm.generate(PROMPTS[:2], params(early_exit=False), on_step=lambda a: seen.append(a.clone()))
    assert seen and seen[-1].shape == (2, 16)
    assert (seen[0] == llm.model.config.mask_token_id).any()
    assert not (seen[-1] == llm.model.config.mask_token_id).any()


def test_missing_or_corrupt_checkpoint(tiny_checkpoint, tmp_path):
    with pytest.raises(CheckpointError):
        LLM(tmp_path / "missing", device="cpu")
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    (broken / "tokenizer.json").write_text("{ not a tokenizer")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        LLM(broken, device="cpu")


def test_generation_config_supplies_defaults(tiny_checkpoint, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, folder)
    (folder / "generation_config.json").write_text(json.dumps({"max_tokens": 5, "steps": 5, "block_length": 5}))
    llm = LLM(folder, device="cpu")
    out = llm.generate("import os")[0]
    assert len(out.token_ids) <= 5
    assert out.nfe <= 5
    assert torch.device("cpu") == next(llm.model.parameters()).device


def test_embedded_models_resolve_by_name(tmp_path, monkeypatch):
    from celeris.llm import DEFAULT_MODEL, EMBEDDED, resolve_model

    assert resolve_model(None) == DEFAULT_MODEL == resolve_model("smollm2-135m-instruct-dflash")
    assert resolve_model("celeris-code-6m-hybrid") == EMBEDDED / "celeris-code-6m-hybrid"
    assert resolve_model("celeris-code-6m") == EMBEDDED / "celeris-code-6m"  # the masked-diffusion model
    assert resolve_model("no-such-model") == Path("no-such-model")  # the loader then names it
    monkeypatch.chdir(tmp_path)
    (tmp_path / "celeris-code-6m-hybrid").mkdir()  # a folder of that name here wins over the embedded one
    assert resolve_model("celeris-code-6m-hybrid") == Path("celeris-code-6m-hybrid")
    assert resolve_model(str(EMBEDDED / "celeris-code-6m-hybrid")) == EMBEDDED / "celeris-code-6m-hybrid"


def test_causal_checkpoint_defaults_to_one_token_blocks(tiny_checkpoint, tokenizer_dir, tmp_path):
    """An autoregressive checkpoint whose generation config asks for diffusion settings (an older export)
    still generates by default: blocks of one token and the delayed cache."""
    from celeris.models.loader import save_checkpoint
    from tests.conftest import TINY, tiny_model

    config = json.loads((tiny_checkpoint / "config.json").read_text())
    model = tiny_model(**{k: config[k] for k in (*TINY, "vocab_size", "eos_token_id", "mask_token_id",
                                                 "pad_token_id") if k in config}, is_causal=True)
    save_checkpoint(model, tmp_path / "twin", tokenizer_dir, {"max_tokens": 6, "block_length": 32, "cache": "dual"})
    twin = LLM(tmp_path / "twin")
    params = twin.default_params()
    assert (params.block_length, params.cache, params.max_tokens) == (1, "delayed", 6)
    out = twin.generate("def f", params)[0]
    assert out.nfe == min(len(out.token_ids) + 1, 6)


def test_max_batch_size_is_a_deprecated_alias_of_max_num_seqs(tiny_checkpoint):
    assert LLM(tiny_checkpoint, device="cpu", max_num_seqs=3).engine_config.max_num_seqs == 3
    with pytest.warns(DeprecationWarning, match="max_num_seqs"):
        assert LLM(tiny_checkpoint, device="cpu", max_batch_size=2).engine_config.max_num_seqs == 2


def test_block_model_takes_its_sub_block_when_block_length_is_left_at_the_default(tmp_path):
    """SamplingParams' generic block_length (32) does not divide SDAR's block of 4: left unset, the contract's
    sub-block is used (as the reference sampler does); a block_length the caller chose is still checked."""
    from celeris.reference.block import generate_block
    from tests.models.conftest_block_formats import write_sdar

    write_sdar(tmp_path)
    llm = LLM(tmp_path, device="cpu")
    params = SamplingParams(max_tokens=8, temperature=0)
    out = llm.generate(["def f(x):"], params)[0]
    prompt = llm.tokenizer.encode("def f(x):")
    ref = generate_block(llm.model, [prompt], params, end_ids=llm.end_token_ids)
    assert out.token_ids == ref.token_ids[0] and out.nfe == ref.nfe
    assert out.token_ids == llm.generate(["def f(x):"], SamplingParams(max_tokens=8, temperature=0,
                                                                       block_length=4))[0].token_ids
    with pytest.raises(ValueError, match="block_length 8 must divide"):
        llm.generate(["def f(x):"], SamplingParams(max_tokens=8, block_length=8))


# ---------------------------------------------------------------------------------------------
# A default max_tokens fits the context (issue 28 item 8): vLLM's min(context - prompt, the default)


def prompt_of(llm: LLM, num_tokens: int) -> list[int]:
    """``num_tokens`` ids of ordinary text (no special id)."""
    ids = llm.tokenizer.encode("def fibonacci(n):\n    return n\n" * 40)
    assert len(ids) >= num_tokens
    return ids[:num_tokens]


def test_a_default_max_tokens_is_lowered_to_what_fits(llm):
    """The tiny folder: a 64-token context, generation_config.json's max_tokens 16 and steps 16."""
    from celeris.sampling.modes import ContextLengthError

    ids = prompt_of(llm, 60)
    fitted = llm.fit_max_tokens(llm.default_params(), len(ids))
    assert (fitted.max_tokens, fitted.steps) == (4, 4)  # the default's tokens per step kept
    assert llm.fit_max_tokens(llm.default_params(), 10).max_tokens == 16  # room enough: the default
    assert llm.fit_max_tokens(llm.default_params(steps=2), len(ids)).steps == 2  # steps the caller gave are kept
    out = llm.generate([ids])[0]  # no params: the model's defaults
    assert out.finish_reason in ("stop", "length") and len(out.token_ids) <= 4
    assert len(llm.generate([ids], SamplingParams(block_length=4))[0].token_ids) <= 4  # SamplingParams' own default
    with pytest.raises(ContextLengthError, match=r"plus max_tokens \(16\) need 76 tokens"):  # the caller's value
        llm.generate([ids], llm.default_params(max_tokens=16))
    with pytest.raises(ContextLengthError) as info:  # not one token fits: no max_tokens the caller never sent
        llm.generate([prompt_of(llm, 64)])
    assert "64" in str(info.value) and "max_tokens" not in str(info.value) and "16" not in str(info.value)


def test_a_folder_without_generation_config_fits_the_default_too(tiny_checkpoint, tmp_path):
    folder = tmp_path / "no-generation-config"
    shutil.copytree(tiny_checkpoint, folder)
    (folder / "generation_config.json").unlink()
    llm = LLM(folder, device="cpu")
    assert llm.default_params().max_tokens == SamplingParams().max_tokens == 128  # more than the 64-token context
    assert llm.fit_max_tokens(llm.default_params(), 8).max_tokens == 56
    assert len(llm.generate([prompt_of(llm, 58)])[0].token_ids) <= 6


def test_a_block_folder_without_max_tokens_fits_its_contract_default(tmp_path):
    """The tiny SDAR folder: a 256-token context and the contract's max_tokens 256, so every request without
    max_tokens used to fail, even a 3-token prompt; a block model's steps count per block and are kept."""
    from tests.models.conftest_block_formats import write_sdar

    write_sdar(tmp_path)
    llm = LLM(tmp_path, device="cpu")
    defaults = llm.default_params()
    assert (defaults.max_tokens, llm.context_length) == (256, 256)
    fitted = llm.fit_max_tokens(defaults, 3)
    assert (fitted.max_tokens, fitted.steps) == (253, defaults.steps)
    ids = llm.tokenizer.encode("def fibonacci(n):\n    return n\n" * 60)[:250]
    assert len(ids) == 250
    assert len(llm.generate([ids])[0].token_ids) <= 6


@pytest.fixture
def other_tokenizer(tiny_checkpoint, tmp_path) -> Path:
    """The checkpoint's tokenizer files in another folder, with a chat template of their own."""
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(tiny_checkpoint / "tokenizer.json", folder)
    config = json.loads((tiny_checkpoint / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_tokenizer_and_chat_template_replace_the_checkpoints(llm, tiny_checkpoint, other_tokenizer, tmp_path):
    """LLM(tokenizer=...) takes the tokenizer files (folder or tokenizer.json) and their template;
    chat_template=FILE replaces the template; the chat prompt follows the template in force."""
    messages = [{"role": "user", "content": "hi"}]
    own = llm.tokenizer
    swapped = LLM(tiny_checkpoint, device="cpu", tokenizer=other_tokenizer).tokenizer
    assert swapped.chat_template == "{% for m in messages %}[{{ m['content'] }}]{% endfor %}" != own.chat_template
    assert swapped.decode(swapped.encode_chat(messages)) == "[hi]"
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    tok = LLM(tiny_checkpoint, device="cpu", tokenizer=other_tokenizer / "tokenizer.json",
              chat_template=template).tokenizer
    assert tok.decode(tok.encode_chat(messages)) == "<user>hi"
    assert (tok.eos_token_id, tok.mask_token_id) == (own.eos_token_id, own.mask_token_id)


def test_missing_tokenizer_or_template_is_named(tiny_checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer '.*nowhere' does not exist"):
        LLM(tiny_checkpoint, device="cpu", tokenizer=tmp_path / "nowhere")
    with pytest.raises(ValueError, match="chat template file '.*none.jinja' does not exist"):
        LLM(tiny_checkpoint, device="cpu", chat_template=tmp_path / "none.jinja")
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        LLM(tiny_checkpoint, device="cpu", chat_template=tmp_path / "bad.jinja")
