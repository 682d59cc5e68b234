"""Cross-check the PEFT-layout reader and writer against PEFT itself (a dev-only
dependency installed by the set-up, never needed at serving time):
adapters PEFT saves load here with the same outputs, and adapters saved here
load in PEFT with the same outputs."""

import peft
import pytest
import torch
import transformers

from bitdelta.merge.adapter import load_adapter, save_adapter
from bitdelta.merge.lora import applied
from bitdelta.model import load_model
from tests.support.family import make_tiny_family


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    b, _ = make_tiny_family(tmp_path_factory.mktemp("peft"), n_variants=0)
    return b


def _hf(base):
    return transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"use_rslora": True},
        {"rank_pattern": {"v_proj": 2}, "alpha_pattern": {"layers.1.self_attn.q_proj": 3.0}},
    ],
)
def test_peft_saved_adapter_gives_the_same_outputs(base, tmp_path, extra):
    torch.manual_seed(0)
    cfg = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False,
        task_type="CAUSAL_LM",
        **extra,
    )
    model = peft.get_peft_model(_hf(base), cfg).eval()
    model.save_pretrained(str(tmp_path / "task"))
    x = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        want = model(x).logits
    ours = load_model(base)
    adapter = load_adapter(tmp_path / "task")
    assert len(adapter.modules) == 6
    with applied(ours, adapter):
        torch.testing.assert_close(ours(x), want, atol=2e-5, rtol=1e-4)


def test_adapter_saved_here_loads_in_peft(base, tmp_path):
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    src = peft.get_peft_model(_hf(base), cfg)
    src.save_pretrained(str(tmp_path / "src"))
    adapter = load_adapter(tmp_path / "src")
    # Give one module another rank and scale so the written rank/alpha patterns are exercised.
    from bitdelta.merge.adapter import dense_to_lora

    name = "model.layers.0.self_attn.v_proj"
    adapter.modules[name] = dense_to_lora(0.01 * torch.randn(adapter.modules[name].shape), 2)
    save_adapter(adapter, tmp_path / "ours")
    model = peft.PeftModel.from_pretrained(_hf(base), str(tmp_path / "ours")).eval()
    x = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        want = model(x).logits
    ours = load_model(base)
    with applied(ours, adapter):
        torch.testing.assert_close(ours(x), want, atol=2e-5, rtol=1e-4)
