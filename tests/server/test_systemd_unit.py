"""deploy/pipeline-serve.service: systemd accepts it as written, and its timeouts fit the server's
own (a stop that systemd cuts short would lose the requests the drain is finishing)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.supervisor import SupervisorConfig
from server.config import ServerConfig
from server.serve import FINAL_WRITE_GRACE_S
from stages.engine_lifecycle import STOP_ORDER

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "pipeline-serve.service"
INSTALLED_AT = "/opt/pipeline-serve"


def service_settings() -> dict[str, str]:
    settings: dict[str, str] = {}
    section = ""
    for line in UNIT.read_text().splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif section == "Service" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings[key] = value
    return settings


def test_the_unit_notifies_and_is_watched() -> None:
    settings = service_settings()
    assert settings["Type"] == "notify" and settings["NotifyAccess"] == "main"
    assert int(settings["WatchdogSec"]) > 0
    assert settings["Restart"] == "on-failure"


def test_systemd_waits_for_the_whole_shutdown() -> None:
    """TimeoutStopSec covers the drain, the last writes and every stage's stop (SIGTERM, then
    SIGKILL after the supervisor's stop timeout, each waited for as long again)."""
    stages_s = len(STOP_ORDER) * 2 * SupervisorConfig().stop_timeout_s
    needed_s = ServerConfig().shutdown_timeout_s + FINAL_WRITE_GRACE_S + stages_s
    assert int(service_settings()["TimeoutStopSec"]) >= needed_s


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    """On a copy installed here: verify checks that ExecStart's program exists."""
    checkout = Path(__file__).resolve().parents[2]
    program = Path(sys.prefix) / "bin" / "pipeline-serve"
    assert program.exists(), "`make install` puts the pipeline-serve entry point in the venv"
    text = UNIT.read_text()
    assert f"ExecStart={INSTALLED_AT}/.venv/bin/pipeline-serve " in text
    text = text.replace(f"{INSTALLED_AT}/.venv/bin/pipeline-serve", str(program))
    text = text.replace(f"WorkingDirectory={INSTALLED_AT}", f"WorkingDirectory={checkout}")
    unit = tmp_path / UNIT.name
    unit.write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    # verify exits 0 on unknown keys and bad values too; it says so on stderr.
    assert result.returncode == 0 and result.stderr == "", result.stderr
