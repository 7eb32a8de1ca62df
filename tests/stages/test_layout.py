"""The layers hold at run time: what each lean process loads when it imports its entry point."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "triton", "gpu")


def loaded_after(*modules: str) -> set[str]:
    """The modules a fresh interpreter holds after importing `modules`."""
    code = (
        "import json, sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


def roots(names: set[str]) -> set[str]:
    return {n.split(".")[0] for n in names}


def test_the_server_process_loads_no_torch_no_llguidance_and_no_actor():
    loaded = loaded_after("server.cli", "stages.engine", "stages.data_parallel")
    assert not roots(loaded) & {*HEAVY, "llguidance"}
    assert not [n for n in loaded if n.startswith("stages.actors")]


def test_the_server_process_loads_no_scheduler_block_manager_or_proposer():
    # The gauges' names, the plan's layout and the speculative config are the vocabulary the
    # server shares with schedule; the policies behind them stay in schedule's process.
    loaded = loaded_after("server.cli", "stages.engine", "stages.data_parallel")
    schedule_only = {
        "stages.scheduler",
        "stages.kv_blocks",
        "stages.speculation",
        "stages.draft_policy",
        "stages.beam_group",
        "stages.beam_search",
    }
    assert not loaded & schedule_only
    assert {"stages.rings.gauges", "stages.rings.plan", "stages.speculative_config"} <= loaded


@pytest.mark.parametrize("actor", ["render", "detokenize", "schedule"])
def test_the_lean_stages_load_no_torch_and_no_engine_client(actor: str):
    loaded = loaded_after(f"stages.actors.{actor}")
    assert not roots(loaded) & set(HEAVY)
    assert "stages.engine" not in loaded and "server" not in roots(loaded)
    others = {f"stages.actors.{a}" for a in ("render", "schedule", "execute", "detokenize")}
    assert not loaded & (others - {f"stages.actors.{actor}"})
