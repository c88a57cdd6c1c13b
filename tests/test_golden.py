"""Golden multi-round regression: a small decoupled run and a synchronous-DiLoCo run, end to end.

Every part is the real code (learners with their links, the synchronizer, ledger and store) on the
simulated clock, so the global fragments after many outer rounds are a pure function of the code.
They are compared with a stored fixture to 1e-6: any change to the learner, the merge math, the
outer optimizer, the compression or the policy shows up here. When a change to the math is meant,
regenerate the fixture (``python tests/test_golden.py --regenerate``) and say why in the commit.

Float rounding depends on the CPU's vector kernels and on how many threads split a reduction (after
30 rounds of training, 1e-4 apart between an AVX-512 and an AVX2 machine, or 1 and 2 threads), so
the run happens in a child process pinned to one thread, torch's portable kernels and MKL's
reproducible mode, with oneDNN's and MKL's instruction sets capped at AVX2 (an AVX-512 AMD EPYC
gave 1.2e-3 differences without the cap, after int8 rounding amplified them). That gives the same bits
on the AVX2 machine that made the fixture and on AMD's AVX-512 EPYC, but not on an AVX-512 Intel Xeon
(1.1e-3 apart, repeatable there, whichever of MKL's and oneDNN's instruction-set caps was tried; MKL dispatching by
vendor is the likely cause). So that family has a fixture of its own, made from the same code;
after a meant change, regenerate the fixture on a machine of each family.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from support import tiny_config

from ddiloco.inprocess import Outage, run_inprocess
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.run_state import read_version

FIXTURES = Path(__file__).parent / "fixtures"
FAMILIES_WITH_A_FIXTURE = ("GenuineIntel-AVX512",)
"""CPU families whose pinned numerics differ from the default fixture's, each with ``golden_rounds.<family>.safetensors``."""
PINNED = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
          "CUDA_VISIBLE_DEVICES": "", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
"""Read when torch starts, so only a fresh process can have them."""


def cpu_family() -> str:
    """``<vendor>-<widest vector set>`` from /proc/cpuinfo, e.g. ``GenuineIntel-AVX512``."""
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", text, re.M)
    flags = set(m.group(1).split()) if (m := re.search(r"^flags\s*:(.*)$", text, re.M)) else set()
    vectors = "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "other"
    return f"{vendor.group(1) if vendor else platform.machine()}-{vectors}"


def fixture_path(family: str) -> Path:
    """The fixture this CPU family's pinned run must reproduce."""
    name = f"golden_rounds.{family}.safetensors" if family in FAMILIES_WITH_A_FIXTURE else "golden_rounds.safetensors"
    return FIXTURES / name


def golden_config(kind: str):
    """4 learners in 2 regions, one of them at half speed; int8 outer gradients, 4 fragments, overlap 2
    (``decoupled``), or P = 1, overlap 0, overwrite, no compression (``sync``: synchronous DiLoCo)."""
    sections = dict(
        learners={
            "batch_size": 4,
            "regions": [{"name": "us", "learners": 2}, {"name": "eu", "learners": 2, "speeds": [1.0, 0.5]}],
            "heartbeat_s": 1.0,
            "save_optimizer_every": 7,
        },
        fragments={"count": 4, "overlap": 2},
        compression={"codec": "int8"},
    )
    if kind == "sync":
        sections.update(fragments={"count": 1, "overlap": 0}, compression={"codec": "none"}, merge={"on_receipt": "overwrite"})
    return tiny_config(**sections)


def golden_fragments() -> dict[str, torch.Tensor]:
    """``kind/v<version>/f<fragment>/<tensor>`` of the newest global version of every fragment."""
    out = {}
    for kind in ("decoupled", "sync"):
        cfg = golden_config(kind)
        outages = [Outage("eu-0", 5.0, 12.0)] if kind == "decoupled" else []
        run = run_inprocess(cfg, total_tokens=4 * 4 * cfg.model.seq_len * 30, outages=outages)
        with run.ctx.reading() as s:
            latest = runs_q.latest_versions(s, run.ctx.run_id)
        store = run.ctx.store()
        for p, row in sorted(latest.items()):
            for name, t in read_version(store, row).items():
                out[f"{kind}/v{row.version}/f{p}/{name}"] = t.contiguous()
    return out


def pinned_golden_fragments(path: Path) -> dict[str, torch.Tensor]:
    """:func:`golden_fragments` computed in a child process with the kernels and threads pinned, saved to ``path``."""
    env = {**os.environ, **PINNED, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, __file__, "--emit", str(path)], env=env, check=True, timeout=300)
    return load_file(str(path))


def test_global_fragments_after_many_rounds_match_the_golden_fixture(tmp_path):
    fixture = fixture_path(cpu_family())
    want = load_file(str(fixture))
    got = pinned_golden_fragments(tmp_path / "golden.safetensors")
    # Keys carry the version numbers: the same number of merges happened per fragment.
    assert sorted(got) == sorted(want)
    assert max(int(k.split("/")[1][1:]) for k in got if k.startswith("decoupled/")) >= 8
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6, msg=lambda m, k=key: f"{k} (against {fixture.name}): {m}")


if __name__ == "__main__" and sys.argv[1:2] == ["--emit"]:
    torch.set_num_threads(1)
    save_file(golden_fragments(), sys.argv[2])
elif __name__ == "__main__" and sys.argv[1:] == ["--regenerate"]:
    target = fixture_path(cpu_family())
    pinned_golden_fragments(target)
    print(f"wrote {target} (CPU family {cpu_family()}; regenerate on a machine of each family: {FAMILIES_WITH_A_FIXTURE} and any other)")
