"""Run configuration: every example validates, errors name the field, env beats the file, TOML works."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddiloco.platform.config import ConfigError, RunConfig, build_config, load_config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*") if p.suffix in (".yaml", ".yml", ".toml"))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """No DDILOCO_* override from the calling shell leaks into these tests."""
    for key in list(os.environ):
        if key.startswith("DDILOCO_"):
            monkeypatch.delenv(key)


def test_there_are_examples():
    assert {p.name for p in EXAMPLES} >= {"tiny.yaml", "multi-region.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_validates(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert cfg.learners.count >= 1 and cfg.fragments.count >= 1
    # The saved form reloads to the same config (it is what the ledger keeps with the run).
    assert build_config(cfg.model_dump(mode="json")) == cfg


def test_tiny_example_is_tiny_and_local():
    cfg = load_config(ROOT / "examples" / "tiny.yaml")
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.fragments.count) == (1, 32, 4)
    assert cfg.ledger.url.get_secret_value().startswith("sqlite:///") and cfg.storage.url.startswith("file://")


def test_multi_region_example():
    cfg = load_config(ROOT / "examples" / "multi-region.yaml")
    assert [r.name for r in cfg.learners.regions] == ["us", "eu", "asia"]
    assert cfg.ledger.url.get_secret_value() == "postgresql+psycopg://postgres@127.0.0.1:5432/ddiloco"
    assert cfg.compression.codec == "int4"
    assert cfg.storage.url.startswith("s3://ddiloco-runs")
    own = [r for r in cfg.learners.regions if r.storage_url]
    assert len(own) == 1
    assert cfg.storage_url_for(own[0].name) == own[0].storage_url != cfg.storage.url
    assert cfg.storage_url_for("us") == cfg.storage.url


def _error(data: dict) -> str:
    with pytest.raises(ConfigError) as err:
        build_config(data)
    return str(err.value)


def test_wrong_codec_names_field_and_allowed_values():
    msg = _error({"compression": {"codec": "zip"}})
    assert "compression.codec" in msg
    for allowed in ("none", "bf16", "int8", "int4"):
        assert allowed in msg


def test_negative_quorum_names_field():
    msg = _error({"quorum": {"min_count": -1}})
    assert "quorum.min_count" in msg and "greater than or equal to 1" in msg


def test_unknown_keys_are_named():
    assert "colour" in _error({"colour": "blue"})
    assert "outer.lrr" in _error({"outer": {"lrr": 0.1}})
    assert "learners.regions.0.bucket" in _error({"learners": {"regions": [{"name": "us", "bucket": "x"}]}})


def test_every_bad_field_is_reported_at_once():
    msg = _error({"compression": {"codec": "zip"}, "outer": {"lr": -1}, "grace": {"gamma": 2}})
    assert "compression.codec" in msg and "outer.lr" in msg and "grace.gamma" in msg


def test_cross_field_rules():
    assert "divisible" in _error({"model": {"d_model": 30, "n_head": 4}})
    assert "unique" in _error({"learners": {"regions": [{"name": "us"}, {"name": "us"}]}})
    assert "learners.regions.0.name" in _error({"learners": {"regions": [{"name": "../etc"}]}})
    assert "grace.max_s" in _error({"grace": {"min_s": 5, "max_s": 1}})
    # Decoding on the device keeps a float32 copy of the model there: a ddp learner's, in its own process.
    assert "decode_on_device needs learners.parallelism ddp" in _error({"learners": {"decode_on_device": True, "parallelism": "fsdp"}})
    assert "set one of them" in _error({"learners": {"decode_on_device": True, "link_process": True}})
    assert build_config({"learners": {"decode_on_device": True}}).learners.decode_on_device


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("outer: [unclosed\n")
    with pytest.raises(ConfigError, match="does not parse"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listy)
    wrong_ext = tmp_path / "conf.ini"
    wrong_ext.write_text("[x]\n")
    with pytest.raises(ConfigError, match=r"\.yaml"):
        load_config(wrong_ext)


def test_env_override_beats_the_file(tmp_path, monkeypatch):
    path = tmp_path / "run.yaml"
    path.write_text("name: envtest\nouter:\n  lr: 0.3\n  momentum: 0.8\n")
    assert load_config(path).outer.lr == 0.3
    monkeypatch.setenv("DDILOCO_OUTER__LR", "0.5")
    cfg = load_config(path)
    assert cfg.outer.lr == 0.5
    assert cfg.outer.momentum == 0.8  # the rest of the section still comes from the file
    assert cfg.name == "envtest"
    monkeypatch.setenv("DDILOCO_COMPRESSION__CODEC", "zip")
    with pytest.raises(ConfigError, match="compression.codec"):
        load_config(path)


def test_toml_loads_like_yaml(tmp_path):
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text(
        "name: same\nfragments:\n  count: 6\nlearners:\n  regions:\n    - name: us\n      learners: 3\n"
        "compression:\n  codec: bf16\n"
    )
    toml_path = tmp_path / "run.toml"
    toml_path.write_text(
        'name = "same"\n[fragments]\ncount = 6\n[[learners.regions]]\nname = "us"\nlearners = 3\n'
        '[compression]\ncodec = "bf16"\n'
    )
    from_toml = load_config(toml_path)
    assert from_toml == load_config(yaml_path)
    assert from_toml.fragments.count == 6 and from_toml.learners.count == 3 and from_toml.compression.codec == "bf16"
    bad = tmp_path / "bad.toml"
    bad.write_text('[compression]\ncodec = "zip"\n')
    with pytest.raises(ConfigError, match="compression.codec"):
        load_config(bad)


@pytest.mark.parametrize("region_deploy, nproc, device, expected", [
    ({"gpus": 1}, 8, "auto", "regions.us.deploy.gpus: 1 GPUs for learners.nproc_per_node = 8 ranks: each rank takes one GPU"),
    ({"gpus": 2}, 1, "cpu", "regions.us.deploy.gpus: learners.device is cpu: the pod's 2 GPUs would stay idle"),
    ({"gpus": 0}, 1, "cuda", "regions.us.deploy.gpus: learners.device is cuda: a learner pod needs GPUs"),
    ({"node_selector": {"gpu type": "h100"}}, 1, "auto", "'gpu type'='h100' is not a Kubernetes node label"),
    ({"shm_size": "lots"}, 1, "auto", "'lots' is not a Kubernetes quantity"),
    ({"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "value": "x"}]}, 1, "auto", "operator Exists takes no value"),
    ({"work_pool": "pool/../x"}, 1, "auto", "is not a work pool or queue name"),
    ({"image": "ddiloco:cuda; rm -rf /"}, 1, "auto", "is not an image reference"),
])
def test_a_regions_deploy_section_is_refused_with_a_line_naming_the_field(region_deploy, nproc, device, expected):
    message = _error({"learners": {"nproc_per_node": nproc, "device": device, "regions": [{"name": "us", "deploy": region_deploy}]}})
    [line] = [m for m in message.splitlines()[1:]]
    assert line.strip().startswith("learners") and expected in line, message


def test_pods_get_one_gpu_per_rank_unless_the_learners_run_on_the_cpu():
    regions = [{"name": "a"}, {"name": "b", "deploy": {"gpus": 0}}]
    for device, expected in (("auto", [4, 0]), ("cuda", None), ("cpu", [0, 0])):
        if expected is None:
            assert "a learner pod needs GPUs" in _error({"learners": {"nproc_per_node": 4, "device": device, "regions": regions}})
            continue
        learners = build_config({"learners": {"nproc_per_node": 4, "device": device, "regions": regions}}).learners
        assert [learners.pod_gpus(r) for r in learners.regions] == expected, device
