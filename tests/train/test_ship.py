"""Session-sized training steps (celeris.train.ship): the budget's parsing, and a shipped drafter replaced only by
one that accepts more on the held-out rows, every step recorded in the folder and on its card."""

from __future__ import annotations

import json

import pytest
import torch

from celeris.models.dflash import DFlashConfig, DFlashDraftModel, load_dflash, save_dflash
from celeris.train import ship


def tiny(seed: int) -> DFlashDraftModel:
    torch.manual_seed(seed)
    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=50, num_target_layers=4, block_size=4,
                       rope_theta=10000.0, mask_token_id=3, target_layer_ids=[1, 2])
    return DFlashDraftModel(cfg).eval()


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("30m", 1800), ("2h", 7200), ("1.5h", 5400), ("45", 45)])
def test_durations(text, seconds):
    assert ship.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "2 days", "0m", "-1h", "h"])
def test_bad_durations_are_one_clear_error(text):
    with pytest.raises(ValueError, match="give a positive duration"):
        ship.parse_duration(text)


def test_the_trained_drafter_replaces_the_shipped_one_only_when_it_accepts_more(tmp_path):
    shipped, worse, better = tiny(0), tiny(1), tiny(2)
    save_dflash(shipped, tmp_path)
    (tmp_path / "README.md").write_text("# a drafter\n\nIts card.\n")
    first = "fc.weight"  # random at every seed (the norms start at ones)

    def evaluate(model):  # the held-out tau of each drafter, told apart by its first weight
        for m, tau in ((shipped, 1.5), (worse, 1.4), (better, 1.6)):
            if torch.allclose(model.state_dict()[first].float(), m.state_dict()[first].to(torch.bfloat16).float(),
                              atol=1e-2):
                return {"tau": tau}
        raise AssertionError("an unknown drafter")

    kept = ship.ship_if_better(worse, tmp_path, evaluate, {"date": "d1", "steps": 10, "total_steps": 10})
    assert not kept["replaced"] and "1.4 <= the shipped drafter's 1.5" in kept["why"]
    assert torch.equal(load_dflash(tmp_path).state_dict()[first], shipped.state_dict()[first].to(torch.bfloat16).float())
    assert ship.prior_steps(tmp_path) == 0  # nothing replaced yet
    done = ship.ship_if_better(better, tmp_path, evaluate, {"date": "d2", "steps": 20, "total_steps": 30})
    assert done["replaced"] and (done["shipped_tau"], done["trained_tau"]) == (1.5, 1.6)
    assert torch.equal(load_dflash(tmp_path).state_dict()[first], better.state_dict()[first].to(torch.bfloat16).float())
    assert ship.prior_steps(tmp_path) == 30
    steps = [json.loads(x) for x in (tmp_path / ship.STEPS_FILE).read_text().splitlines()]
    assert [s["replaced"] for s in steps] == [False, True]
    card = (tmp_path / "README.md").read_text()
    assert card.startswith("# a drafter") and card.count(ship.STEPS_HEADING) == 1
    assert "| d1 |" in card and "| 1.5 -> 1.4 | no:" in card and "| d2 |" in card and "| 1.5 -> 1.6 | yes |" in card
    assert not list(tmp_path.parent.glob("tmp*"))  # the staging folder went


def test_no_drafter_in_the_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no drafter there"):
        ship.ship_if_better(tiny(0), tmp_path, lambda m: {"tau": 1.0}, {})
