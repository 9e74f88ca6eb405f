"""The read-only ClickHouse user of the dashboards (infra/clickhouse/users.d/dashboards.xml), as
the real ClickHouse engine (chDB) loads it next to a users.xml like the server image's: it
exists, may SELECT from the flare database and nothing else, and runs with readonly = 1.

chDB is ClickHouse's engine without its server, so two things are out of reach here: logging
in as another user, and the server's `access_control_improvements` (chDB keeps their
defaults). The second matters: `changeable_in_readonly` (max_execution_time, which the Grafana
plugin sets on every query) is refused unless `settings_constraints_replace_previous` is on.
One test shows chDB refusing the file for exactly that reason, and that our config.d file
turns it on; the others load the file with that one marker taken out.
"""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import ROOT

pytestmark = pytest.mark.integration
USERS_D = ROOT / "infra/clickhouse/users.d/dashboards.xml"
CONFIG_D = ROOT / "infra/clickhouse/config.d/access-control.xml"
MARKER = "<changeable_in_readonly/>"
# what the server image's own users.xml provides (default profile, user and quota)
BASE_USERS = """<clickhouse>
  <profiles><default/></profiles>
  <users><default><password/><networks><ip>::/0</ip></networks><profile>default</profile>
    <quota>default</quota><access_management>1</access_management></default></users>
  <quotas><default/></quotas>
</clickhouse>
"""
QUERIES = {
    "users": "SELECT name, storage FROM system.users ORDER BY name",
    "grants": "SHOW GRANTS FOR dashboards",
    "profile": "SELECT setting_name, value, min, max FROM system.settings_profile_elements "
               "WHERE profile_name = 'dashboards' ORDER BY setting_name",
    "user_profile": "SELECT inherit_profile FROM system.settings_profile_elements "
                    "WHERE user_name = 'dashboards'",
}
# one process per engine: chDB keeps one per process, and the test process may hold another
LOAD = """
import json, sys
import chdb.state.sqlitelike as chdb
conn = chdb.connect(sys.argv[1])
cur = conn.cursor()
out = {}
for key, sql in json.loads(sys.argv[2]).items():
    cur.execute(sql)
    out[key] = [list(r) for r in cur.fetchall()]
conn.close()
print(json.dumps(out))
"""


def load(tmp_path: Path, users_d: str) -> subprocess.CompletedProcess[str]:
    """chDB started with users.xml + users.d/dashboards.xml = `users_d`, asked QUERIES."""
    server = tmp_path / "server"
    (server / "users.d").mkdir(parents=True)
    (server / "users.xml").write_text(BASE_USERS)
    (server / "users.d/dashboards.xml").write_text(users_d)
    config = tmp_path / "config.xml"
    config.write_text(f"<clickhouse><user_directories><users_xml><path>{server / 'users.xml'}"
                      "</path></users_xml></user_directories></clickhouse>")
    url = f"file:{tmp_path / 'db'}?config-file={config}"
    return subprocess.run([sys.executable, "-c", LOAD, url, json.dumps(QUERIES)],
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin",
                               "FLARE_CLICKHOUSE_DASHBOARDS_PASSWORD": "reader-pw"})


def test_the_user_may_select_from_flare_only_and_runs_read_only(tmp_path: Path) -> None:
    text = USERS_D.read_text()
    assert text.count(MARKER) == 1
    result = load(tmp_path, text.replace(MARKER, ""))
    assert result.returncode == 0, result.stderr
    got: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    assert ["dashboards", "users_xml"] in got["users"]
    assert got["grants"] == [["GRANT SELECT ON flare.* TO dashboards"]]
    assert got["user_profile"] == [["dashboards"]]
    profile = {name: (value, lo, hi) for name, value, lo, hi in got["profile"]}
    assert profile["readonly"][0] == "1"
    assert profile["max_execution_time"] == ("60", None, "300")
    # its password comes from the server's environment, never from the file
    (user,) = ET.parse(USERS_D).getroot().find("users")  # type: ignore[union-attr]
    password = user.find("password")
    assert password is not None and not (password.text or "").strip()
    assert password.get("from_env") == "FLARE_CLICKHOUSE_DASHBOARDS_PASSWORD"


def test_max_execution_time_stays_changeable_because_our_config_allows_it(
        tmp_path: Path) -> None:
    refused = load(tmp_path, USERS_D.read_text())  # chDB: the server setting is off
    assert refused.returncode != 0
    assert "changeable_in_readonly" in refused.stderr
    assert "settings_constraints_replace_previous" in refused.stderr
    on = ET.parse(CONFIG_D).getroot().find(
        "access_control_improvements/settings_constraints_replace_previous")
    assert on is not None and on.text == "true"
