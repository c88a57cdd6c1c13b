"""A learner's state through torch.distributed.checkpoint (ddiloco.learner_worker.state), resharded on load.

- one process, no process group: model, AdamW and extras round-trip through file://, memory:// and s3://;
- one 2-rank gloo job (rank 0 in the test process, rank 1 a subprocess), shared by the resharding cases:
  a 2-rank FSDP2 save loads into one plain rank and into 2 FSDP2 ranks, a 1-rank save into 2 FSDP2 ranks,
  and a DDP save into one plain rank, each with the same parameters and AdamW state (exp_avg,
  exp_avg_sq, step) as the model that was saved;
- a save without its marker is incomplete, a missing one an error naming its URL; nothing is unpickled:
  a data file that is a pickle is refused without running it, and so is a marker naming a file elsewhere.

This file is also the rank program of the 2-rank job: ``python tests/test_learner_state.py rank DIR RANK WORLD``.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from support import run_rank_pair, tiny_config
from torch import nn

from ddiloco.learner_worker.state import (
    MARKER,
    StateError,
    StateMissing,
    StateRefused,
    is_complete,
    load_state,
    save_state,
)
from ddiloco.platform.models import build_model

pytestmark = pytest.mark.timeout(180)

EXTRAS = {"step": 3, "data_position": 123_456_789_012, "rng": torch.tensor([7, 11, 13], dtype=torch.int64)}


# --- a tiny GPT, a few AdamW steps, and its full state as plain tensors ---------------------------------


def tiny_model(seed: int) -> nn.Module:
    """A 2-block byte GPT (about 42k parameters); ``seed`` alone sets its weights."""
    cfg = tiny_config(model={"kind": "gpt", "n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 16}).model
    return build_model(cfg, seed=seed)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, 256, (2, 17), generator=g)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _full(t: torch.Tensor) -> torch.Tensor:
    # An FSDP2 parameter or moment is a DTensor: gather the whole (a collective: every rank calls it in turn).
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone().contiguous()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and every AdamW moment and step, whole, by parameter name (DDP's ``module.`` dropped)."""
    out = {}
    for name, p in model.named_parameters():
        name = name.removeprefix("module.")
        out[name] = _full(p)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            out[f"{name}/{key}"] = _full(opt.state[p][key])
    return out


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{key} differs"


def assert_extras(extras: dict) -> None:
    assert extras.keys() == EXTRAS.keys()
    assert extras["step"] == 3 and isinstance(extras["step"], int)
    assert extras["data_position"] == 123_456_789_012
    assert torch.equal(extras["rng"], EXTRAS["rng"])


def fresh_plain(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = tiny_model(seed)
    return model, adamw(model)


# --- one process ---------------------------------------------------------------------------------


def test_one_process_round_trip_through_every_store_kind(store_url):
    model, opt = fresh_plain(0)
    train(model, opt, steps=3, seed=0)
    want = full_state(model, opt)
    url = f"{store_url}/t/learners/us-0/state/i0-s3"

    save_state(url, model, opt, EXTRAS)

    assert is_complete(url)
    model2, opt2 = fresh_plain(1)
    assert not torch.equal(next(model2.parameters()), next(model.parameters()))
    extras = load_state(url, model2, opt2)
    assert_same_state(full_state(model2, opt2), want)
    assert_extras(extras)
    # The optimizer keeps its own hyperparameters and goes on training from the loaded moments.
    assert opt2.param_groups[0]["lr"] == 1e-2
    train(model, opt, steps=1, seed=9)
    train(model2, opt2, steps=1, seed=9)
    assert_same_state(full_state(model2, opt2), full_state(model, opt))


def test_model_only_save_and_load(tmp_path):
    model, opt = fresh_plain(0)
    train(model, opt, steps=1, seed=0)
    url = f"file://{tmp_path}/model-only"
    save_state(url, model)
    model2 = tiny_model(1)
    assert load_state(url, model2) == {}
    for (name, p), p2 in zip(model.named_parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, p2), name
    # Asking for AdamW's state from a checkpoint without it is an error, not a fresh AdamW.
    with pytest.raises(StateError, match="loading the learner state at file://.* failed: rank 0: RuntimeError: Missing key in checkpoint"):
        load_state(url, *fresh_plain(1))


class TiedLM(nn.Module):
    """An embedding whose matrix is also the output layer's (as in GPT-2 and small Llamas): one parameter, two names."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(256, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 256, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def test_a_tied_weight_is_saved_once_and_loaded_under_both_names(tmp_path):
    model = TiedLM(0)
    opt = adamw(model)
    train(model, opt, steps=2, seed=0)
    want = full_state(model, opt)
    url = f"file://{tmp_path}/tied"

    save_state(url, model, opt, EXTRAS)

    model2 = TiedLM(1)
    opt2 = adamw(model2)
    assert not torch.equal(model2.embed.weight, model.embed.weight)
    assert_extras(load_state(url, model2, opt2))
    assert_same_state(full_state(model2, opt2), want)
    assert model2.head.weight is model2.embed.weight, "loading untied the weight"
    train(model, opt, steps=1, seed=9)
    train(model2, opt2, steps=1, seed=9)
    assert_same_state(full_state(model2, opt2), full_state(model, opt))


def test_incomplete_and_missing_states(tmp_path):
    model, opt = fresh_plain(0)
    train(model, opt, steps=1, seed=0)
    url = f"file://{tmp_path}/s/i0-s1"
    save_state(url, model, opt, {"step": 1})
    # A save that died before its coordinator wrote the marker: the data files are there, the marker is not.
    (tmp_path / "s" / "i0-s1" / MARKER).unlink()
    missing = f"file://{tmp_path}/s/never"

    assert not is_complete(url)
    assert not is_complete(missing)
    for where in (url, missing):
        with pytest.raises(StateMissing) as err:
            load_state(where, *fresh_plain(1))
        assert str(err.value).startswith(f"no complete learner state at {where} ") and "\n" not in str(err.value)
    # A save that died is written over; a complete one never is.
    save_state(url, model, opt, {"step": 1})
    assert load_state(url, *fresh_plain(1)) == {"step": 1}
    with pytest.raises(FileExistsError, match="already at"):
        save_state(url, model, opt, {"step": 2})
    assert load_state(url, *fresh_plain(1)) == {"step": 1}


class _RunsCode:
    def __reduce__(self):  # what a hostile data file would carry if anything unpickled it
        return (os.system, ("touch pwned",))


def test_a_data_file_that_is_a_pickle_is_refused_without_running_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, opt = fresh_plain(0)
    url = f"file://{tmp_path}/hostile"
    save_state(url, model, opt)
    (data,) = json.loads((tmp_path / "hostile" / MARKER).read_text())["files"]
    (tmp_path / "hostile" / data).write_bytes(pickle.dumps(_RunsCode()))

    assert is_complete(url)
    with pytest.raises(StateRefused, match="unreadable data file"):
        load_state(url, *fresh_plain(1))
    assert not (tmp_path / "pwned").exists()


def test_a_data_file_outside_the_checkpoint_is_refused(tmp_path):
    model, opt = fresh_plain(0)
    save_state(f"file://{tmp_path}/ok", model, opt)
    marker = tmp_path / "ok" / MARKER
    content = json.loads(marker.read_text())
    content["files"] = ["../elsewhere/__0_0.distcp"]
    marker.write_text(json.dumps(content))

    with pytest.raises(StateRefused, match="outside the checkpoint directory"):
        load_state(f"file://{tmp_path}/ok", *fresh_plain(1))


def test_non_tensor_extras_are_refused_before_writing(tmp_path):
    model = tiny_model(0)
    with pytest.raises(TypeError, match="'note' is str"):
        save_state(f"file://{tmp_path}/x", model, extras={"note": "hi"})
    with pytest.raises(ValueError, match="without dots"):
        save_state(f"file://{tmp_path}/x", model, extras={"a.b": 1})
    assert not is_complete(f"file://{tmp_path}/x")


# --- a 2-rank gloo job, shared by the resharding cases ---------------------------------------------


def fsdp2_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = tiny_model(seed)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, adamw(model)


def rank_main(workdir: Path, rank: int, world: int) -> None:
    """Both ranks: save a trained FSDP2 model and a DDP one, load states into fresh FSDP2 models, write what they hold."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir / 'pg'}", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        out: dict = {}
        # FSDP2, 2 ranks: save (each rank trains on its own batches; FSDP2 averages the gradients).
        model, opt = fsdp2_model(0)
        train(model, opt, steps=3, seed=100 + rank)
        t0 = time.perf_counter()
        save_state(f"file://{workdir}/fsdp2", model, opt, EXTRAS)
        out["save_s"] = time.perf_counter() - t0
        save_file(full_state(model, opt), str(workdir / f"saved-fsdp2-{rank}.safetensors"))
        # ... and load into 2 fresh FSDP2 ranks, from the 2-rank save and from the 1-rank save.
        for name in ("fsdp2", "one"):
            model, opt = fsdp2_model(5)
            extras = load_state(f"file://{workdir}/{name}", model, opt)
            save_file(full_state(model, opt), str(workdir / f"{name}-into-fsdp2-{rank}.safetensors"))
            out[f"{name}_extras"] = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in extras.items()}
        # DDP, 2 ranks: every rank holds the whole model; DCP writes one copy.
        model = DDP(tiny_model(0))
        opt = adamw(model)
        train(model, opt, steps=2, seed=200 + rank)
        save_state(f"file://{workdir}/ddp", model, opt)
        save_file(full_state(model, opt), str(workdir / f"saved-ddp-{rank}.safetensors"))
        # FSDP2, 2 ranks, with a tied weight: saved once, loaded into fresh FSDP2 ranks under both names.
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(TiedLM(0))
        opt = adamw(model)
        train(model, opt, steps=2, seed=300 + rank)
        save_state(f"file://{workdir}/tied", model, opt, EXTRAS)
        save_file(full_state(model, opt), str(workdir / f"saved-tied-{rank}.safetensors"))
        model = fully_shard(TiedLM(1))
        opt = adamw(model)
        load_state(f"file://{workdir}/tied", model, opt)
        save_file(full_state(model, opt), str(workdir / f"tied-into-fsdp2-{rank}.safetensors"))
        out["tied_kept"] = model.head.weight is model.embed.weight
        (workdir / f"rank-{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """The 2-rank job's directory, after a 1-rank save ("one") and the job itself have run."""
    workdir = tmp_path_factory.mktemp("dcp")
    model, opt = fresh_plain(0)
    train(model, opt, steps=3, seed=0)
    save_state(f"file://{workdir}/one", model, opt, EXTRAS)
    save_file(full_state(model, opt), str(workdir / "saved-one.safetensors"))

    run_rank_pair(__file__, workdir, rank_main)
    return workdir


def _saved(workdir: Path, name: str) -> dict[str, torch.Tensor]:
    """The full state a job saved; both ranks of a 2-rank job must agree on it."""
    if name == "one":
        return load_file(str(workdir / "saved-one.safetensors"))
    ranks = [load_file(str(workdir / f"saved-{name}-{r}.safetensors")) for r in range(2)]
    assert_same_state(ranks[1], ranks[0])
    return ranks[0]


@pytest.mark.slow
def test_two_rank_fsdp2_save_loads_into_one_plain_rank(job):
    model, opt = fresh_plain(7)
    extras = load_state(f"file://{job}/fsdp2", model, opt)
    assert_same_state(full_state(model, opt), _saved(job, "fsdp2"))
    assert_extras(extras)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp2", "one"])
def test_two_and_one_rank_saves_load_into_two_fsdp2_ranks(job, name):
    want = _saved(job, name)
    for rank in range(2):
        assert_same_state(load_file(str(job / f"{name}-into-fsdp2-{rank}.safetensors")), want)
        extras = json.loads((job / f"rank-{rank}.json").read_text())[f"{name}_extras"]
        assert extras == {"step": 3, "data_position": 123_456_789_012, "rng": [7, 11, 13]}


@pytest.mark.slow
def test_a_two_rank_fsdp2_learner_with_a_tied_weight_saves_and_loads_it(job):
    want = _saved(job, "tied")
    assert "head.weight" not in want, "one parameter, named once by named_parameters"
    for rank in range(2):
        assert_same_state(load_file(str(job / f"tied-into-fsdp2-{rank}.safetensors")), want)
        assert json.loads((job / f"rank-{rank}.json").read_text())["tied_kept"], "loading untied the weight"
    model = TiedLM(2)
    opt = adamw(model)
    load_state(f"file://{job}/tied", model, opt)  # and into one plain rank
    assert_same_state(full_state(model, opt), want)
    assert model.head.weight is model.embed.weight


@pytest.mark.slow
def test_a_ddp_save_loads_into_one_plain_rank(job):
    model, opt = fresh_plain(7)
    load_state(f"file://{job}/ddp", model, opt)
    assert_same_state(full_state(model, opt), _saved(job, "ddp"))


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "rank":
    rank_main(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
