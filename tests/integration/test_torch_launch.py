"""The no-code-change way in: `python -m producers.torch_hook.launch`, with FLARE_AGENT.

The settings it reads are tested without torch in tests/unit/producers/torch_hook/test_hook.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
from producers import torch_hook
import torch.distributed as dist
hook = torch_hook.active()
print("ACTIVE" if hook is not None else "INACTIVE", hook and hook.job, sys.argv[1:])
print("PATCHED" if dist.all_reduce.__module__.startswith("producers.torch_hook") else "PLAIN")
"""


@pytest.mark.torch
@pytest.mark.parametrize("flag, expect", [(None, "ACTIVE"), ("1", "ACTIVE"), ("0", "INACTIVE")])
def test_launcher_installs_the_hook_then_runs_the_script(tmp_path, flag, expect):
    pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "FLARE_AGENT"}
    env.update(FLARE_JOB="launch-job", FLARE_AGENT_SOCKET=str(tmp_path / "none.sock"),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if flag is not None:
        env["FLARE_AGENT"] = flag
    out = subprocess.run([sys.executable, "-m", "producers.torch_hook.launch", str(script),
                          "--lr", "0.1"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()[:2]
    assert first.startswith(expect)
    assert first.endswith("['--lr', '0.1']")
    assert second == ("PATCHED" if expect == "ACTIVE" else "PLAIN")
    if expect == "ACTIVE":
        assert "launch-job" in first
