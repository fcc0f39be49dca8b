"""PR #1855's own GPT (its train_gpt.py on CPU stand-ins) against the kit's at PRESET=8xh100-pr1855, toy widths
that keep its structure (11 layers, layers 3-5 looped, 2 lanes from layer 8, every gate): the same weights
through tools/parity/parity_map.py, batches whose rows hold several documents. Skips without ../shared."""

import pytest
import torch

from tools.parity.parity_models import PR1855_SCRIPT, compare_forward, kit_model, packed_batch, record_model, toy_settings
from tools.parity.standins import import_script

pytestmark = pytest.mark.skipif(not PR1855_SCRIPT.is_file(), reason="needs ../shared/reference/pr1855")
DOC_STARTS = ([0, 10, 30, 31, 50], [5, 40])  # row 0 starts with a document, row 1 inside one; a 1-token document


@pytest.fixture(scope="module")
def pair():
    module = import_script(PR1855_SCRIPT)
    hp = toy_settings()
    kit = kit_model(hp)
    x, y = packed_batch(2, hp.train_seq_len, hp.vocab_size, DOC_STARTS)
    return module, hp, kit, record_model(module, kit, hp), x, y


@pytest.mark.parametrize("looping", [False, True])
def test_logits_loss_and_gradients_equal_the_records(pair, looping):
    module, _, kit, record, x, y = pair
    diff = compare_forward(module, kit, record, x, y, looping)
    assert diff["logits"] <= 1e-5 and diff["loss"] <= 1e-6, diff
    assert diff["grad"] <= 1e-4, diff  # relative to each parameter's largest gradient


def test_the_comparison_sees_a_document_leak(pair):
    """The same kit weights without document-packed attention read across BOS: the logits part (the check can fail)."""
    module, hp, kit, record, x, y = pair
    leaky = kit_model(toy_settings(DOC_PACKED_ATTENTION="0"))
    leaky.load_state_dict(kit.state_dict())
    assert compare_forward(module, leaky, record, x, y, looping=True)["logits"] > 1e-2


def test_parameter_count_at_full_size_is_the_records():
    """35,945,671 parameters, as the record's log prints (model_params), on the meta device."""
    from model.gpt import GPT, build_model_config
    from primitives.settings import Hyperparameters

    hp = Hyperparameters.from_env({"PRESET": "8xh100-pr1855"}, log=lambda *_: None)
    with torch.device("meta"):
        model = GPT(**build_model_config(hp))
    assert sum(p.numel() for p in model.parameters()) == 35_945_671
