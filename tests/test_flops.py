"""A learner's model FLOPs per token (counted on the meta device) and its MFU figure."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from support import TINY_LLAMA
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ddiloco.learner_worker.flops import ModelCost, model_cost, peak_flops
from ddiloco.learner_worker.launch import flops_clause
from ddiloco.platform.config import ModelConfig
from ddiloco.platform.data import Batch
from ddiloco.platform.metrics import LearnerFigures
from ddiloco.platform.models import build_model, training_loss
from ddiloco.platform.models.cost import count_flops_per_token
from ddiloco.platform.units import format_flops

MODELS = {
    "gpt": {"kind": "gpt", "n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 32, "vocab_size": 200},
    "hf": {"kind": "hf", "hf_config": TINY_LLAMA, "vocab_size": 256, "seq_len": 32},
    "torchtitan": {"kind": "torchtitan", "titan_args": {"dim": 32, "n_layers": 2, "n_heads": 4, "multiple_of": 32},
                   "vocab_size": 256, "seq_len": 32},
}


def test_a_gpt_costs_what_the_textbook_formula_says_per_token():
    # Forward per token: 2 FLOPs per weight of the blocks' matmuls (12 d^2 per layer: qkv, projection, a 4x MLP), the
    # attention scores and their weighted sum (2 * 2 * T * d per layer) and the output head (2 * d * V); the backward
    # pass costs twice the forward. It is PaLM's 6N + 12 L d T with N the matmul weights.
    L, d, T, V = 2, 64, 32, 200
    expected = 3 * 2 * (12 * d * d * L + 2 * T * d * L + d * V)
    assert count_flops_per_token(ModelConfig(**MODELS["gpt"])) == expected
    # Twice the sequence: the attention term doubles, nothing else moves.
    assert count_flops_per_token(ModelConfig(**{**MODELS["gpt"], "seq_len": 2 * T})) == expected + 3 * 2 * 2 * T * d * L


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_meta_device_count_is_the_count_of_a_real_forward_and_backward(kind):
    if kind == "torchtitan" and importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed")
    cfg = ModelConfig(**MODELS[kind])
    model = build_model(cfg, seed=0)
    for m in model.modules():
        if hasattr(m, "sdpa_backends"):  # torchtitan's attention picks its own kernels; the math one here too
            m.sdpa_backends = [SDPBackend.MATH]
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    # The math backend: torch's counter has no formula for the CPU's fused attention kernel (it would count no attention).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as real:
        training_loss(model, Batch(tokens, tokens, tokens.numel())).backward()
    assert real.get_total_flops() > 0
    assert count_flops_per_token(cfg) == real.get_total_flops() / tokens.numel()


def test_a_model_that_cannot_run_on_the_meta_device_trains_on_without_the_figure():
    cfg = ModelConfig(kind="moe_gpt", n_layer=1, d_model=32, n_head=2, seq_len=16)  # routing reads its data
    with pytest.raises(ValueError, match="^the model does not run on the meta device: aten::"):
        count_flops_per_token(cfg)
    cost = model_cost(cfg, torch.device("cpu"))
    assert cost.flops_per_token is None and cost.mfu(1e6, 1) is None and cost.per_device_flops(1e6, 1) is None
    assert cost.describe().startswith("model FLOPs not counted (the model does not run on the meta device")


def test_a_model_that_cannot_be_built_on_the_meta_device_costs_the_learner_only_its_figure():
    cfg = ModelConfig(kind="import", import_path="json:loads")  # a factory that fails as the learner's would too
    with pytest.raises(ValueError, match="^the model cannot be built on the meta device: model.import_path 'json:loads'"):
        count_flops_per_token(cfg)
    cost = model_cost(cfg, torch.device("cpu"))
    assert cost.flops_per_token is None and cost.describe().startswith("model FLOPs not counted (the model cannot be built")


def test_on_a_cpu_the_learner_reports_model_flops_but_no_mfu():
    cfg = ModelConfig(**MODELS["gpt"])
    cost = model_cost(cfg, torch.device("cpu"))
    assert peak_flops(torch.device("cpu")) == (None, "no peak is published for a cpu device")
    assert cost.flops_per_token == count_flops_per_token(cfg) and cost.peak_flops is None and cost.device_name == "cpu"
    assert cost.per_device_flops(1000.0, 1) == 1000.0 * cost.flops_per_token and cost.mfu(1000.0, 1) is None
    assert cost.describe() == f"{format_flops(cost.flops_per_token)} per token, no MFU (no peak is published for a cpu device)"


def test_mfu_divides_the_jobs_tokens_over_its_devices_and_by_one_devices_peak():
    cost = ModelCost(flops_per_token=6e9, peak_flops=1e15, device_name="NVIDIA H100 80GB HBM3")
    # 8 ranks training 100k tokens/s together: each device does 12.5k tokens/s x 6 GFLOP = 75 TFLOP/s, 7.5% of 1 PFLOP/s.
    assert cost.per_device_flops(100_000, 8) == pytest.approx(75e12)
    assert cost.mfu(100_000, 8) == pytest.approx(0.075)
    assert cost.describe() == "6.00 GFLOP per token, peak 1.00 PFLOP/s (NVIDIA H100 80GB HBM3)"
    assert [format_flops(x) for x in (989e12, 713.687e6, 1234.0, 12.0)] == ["989 TFLOP", "714 MFLOP", "1.23 kFLOP", "12 FLOP"]
    figures = LearnerFigures(step=1, tokens=1, tokens_per_s=100_000, loss=None, upload_queue=0, sent_bytes=0, received_bytes=0,
                             last_version=-1, model_flops_per_s=cost.per_device_flops(100_000, 8), mfu=cost.mfu(100_000, 8))
    assert flops_clause(figures) == ", 75.0 TFLOP/s per device (MFU 7.5%)"
    assert flops_clause(LearnerFigures(1, 1, 1.0, None, 0, 0, 0, -1)) == ""


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed")
def test_a_gpus_peak_comes_from_torchtitans_table_and_an_unlisted_gpu_or_no_torchtitan_gives_no_mfu(monkeypatch):
    name = "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    cuda = torch.device("cuda", 0)
    assert peak_flops(cuda) == (989e12, "")
    cost = model_cost(ModelConfig(**MODELS["gpt"]), cuda)
    assert cost.peak_flops == 989e12 and cost.mfu(1e6, 1) == pytest.approx(1e6 * cost.flops_per_token / 989e12)
    assert cost.describe().endswith("per token, peak 989 TFLOP/s (NVIDIA H100 80GB HBM3)")
    # torchtitan answers an A100's peak for a GPU it does not list: no MFU rather than a wrong one.
    name = "NVIDIA L4"
    assert peak_flops(cuda) == (None, "NVIDIA L4 is not in torchtitan's table of peaks")
    # The table is torchtitan's (the titan extra, not in every image): without it the learner starts, with no MFU.
    name = "NVIDIA H100 80GB HBM3"
    monkeypatch.setitem(sys.modules, "torchtitan.tools.utils", None)
    peak, why = peak_flops(cuda)
    assert peak is None and "torchtitan, which is not installed" in why
    assert model_cost(ModelConfig(**MODELS["gpt"]), cuda).describe().endswith(f"no MFU ({why})")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_known_gpu_has_a_peak_from_torchtitans_table():
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak, why = peak_flops(device)
    assert (peak is None) == bool(why)
    if any(k in name for k in ("H100", "H200", "A100", "B200")):
        assert peak is not None and peak >= 312e12
    cost = model_cost(ModelConfig(**MODELS["gpt"]), device)
    assert (cost.mfu(1e6, 1) is None) == (peak is None)
