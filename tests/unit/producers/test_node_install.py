"""The training-node side installs light: the hook, the node agent, the publisher and the
`flare agent` command import none of the server extra (nor torch, until the hook is installed).

A training image carries the base install only (pyproject: the server packages are the
`server` extra), so a module-level import of one of them here would break every trainer at
start. The check runs in a fresh interpreter: the test process has imported everything.
"""

from __future__ import annotations

import json
import subprocess
import sys

SERVER_ONLY = ("faust", "aiokafka", "chdb", "clickhouse_connect", "pyarrow", "fastapi",
               "uvicorn", "river", "torch")

NODE_SIDE = """
import json, sys
import producers.torch_hook
import producers.torch_hook.buffer, producers.torch_hook.client, producers.torch_hook.groups
import producers.torch_hook.hook, producers.torch_hook.launch, producers.torch_hook.patch
import producers.torch_hook.wire
import producers.agent.cadence, producers.agent.core, producers.agent.outbox
import producers.agent.server
import producers.publisher, producers.live, producers.recording
import flare.settings  # what `flare agent` reads at start
import typer.main
from typer.testing import CliRunner
from flare.cli import app
typer.main.get_command(app)
res = CliRunner().invoke(app, ["agent", "--help"])
assert res.exit_code == 0 and "--keepalive-s" in res.output, res.output
print(json.dumps(sorted(sys.modules)))
"""


def test_the_node_side_imports_no_server_package():
    out = subprocess.run([sys.executable, "-c", NODE_SIDE], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.splitlines()[-1])
    heavy = sorted({m.split(".")[0] for m in loaded} & set(SERVER_ONLY))
    assert heavy == [], f"the training-node side imports {heavy}"
