"""A group's hosts are configured in one place (issue 33): `PREFIXD_GROUP_HOSTS` from an env file
(JSON or comma-separated, as people write it) reaches a managed worker as the worker parses it,
as the hosts of every managed mlx backend that names none of its own; a backend's own `hosts`
and `parallel` win. The worker's side is checked by a real `WorkerSettings` in a child process
reading the environment the supervisor builds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prefixd.backends.supervision.process import worker_env
from prefixd.proxy.cli import effective_backends, load_settings

PAIR = ["127.0.0.1", "127.0.0.1"]


def _env_file(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "prefixd.env"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _worker_reads(env: dict[str, str]) -> tuple[list[str], str]:
    """(group_hosts, parallel) as a worker process parses them from `env`."""
    out = subprocess.run([sys.executable, "-c", (
        "import json; from prefixd.backends.mlx.settings import WorkerSettings as W; "
        "s = W(_env_file=None); print(json.dumps([s.group_hosts, s.parallel]))")],
        env=env, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    hosts, parallel = json.loads(out.stdout)
    return hosts, parallel


@pytest.mark.parametrize("value", ['["127.0.0.1", "127.0.0.1"]', "127.0.0.1,127.0.0.1",
                                   " 127.0.0.1 , 127.0.0.1 "])
def test_group_hosts_from_an_env_file_reach_the_managed_worker(tmp_path: Path,
                                                               value: str) -> None:
    settings = effective_backends(load_settings(_env_file(
        tmp_path, f"PREFIXD_GROUP_HOSTS={value}", "PREFIXD_PARALLEL=pipeline")))
    config = settings.backends[0]
    env = worker_env(config, settings)
    assert _worker_reads(env) == (PAIR, "pipeline")     # was a Python repr: the worker failed
    assert config.hosts == PAIR and config.parallel == "pipeline"
    assert json.loads(env["PREFIXD_GROUP_HOSTS"]) == PAIR


def test_a_backends_own_hosts_win_and_others_take_the_env_files(tmp_path: Path) -> None:
    backends = json.dumps([
        {"name": "own", "kind": "mlx", "model": "m1", "hosts": "10.0.0.1,10.0.0.2",
         "parallel": "tensor"},
        {"name": "plain", "kind": "mlx", "model": "m2"},
        {"name": "up", "kind": "openai", "url": "http://127.0.0.1:9", "models": ["x"]}])
    settings = load_settings(_env_file(tmp_path, "PREFIXD_GROUP_HOSTS=127.0.0.1,127.0.0.1",
                                       f"PREFIXD_BACKENDS={backends}"))
    own, plain, up = settings.backends
    assert (own.hosts, own.parallel) == (["10.0.0.1", "10.0.0.2"], "tensor")
    assert (plain.hosts, plain.parallel) == (PAIR, "auto")
    assert up.hosts == []
    for config in (own, plain):     # each worker gets its backend's group, and only that
        env = worker_env(config, settings)
        assert json.loads(env["PREFIXD_GROUP_HOSTS"]) == config.hosts
        assert env["PREFIXD_PARALLEL"] == config.parallel


def test_one_host_or_none_is_one_process(tmp_path: Path) -> None:
    for line in ("PREFIXD_GROUP_HOSTS=", "PREFIXD_GROUP_HOSTS=127.0.0.1",
                 "PREFIXD_GROUP_HOSTS=[]"):
        settings = effective_backends(load_settings(_env_file(tmp_path, line)))
        env = worker_env(settings.backends[0], settings)
        assert "PREFIXD_GROUP_HOSTS" not in env
        assert _worker_reads(env)[0] == []


def test_bad_group_hosts_are_a_readable_configuration_error(tmp_path: Path) -> None:
    from prefixd.proxy.cli import ConfigError

    with pytest.raises(ConfigError, match="GROUP_HOSTS"):
        load_settings(_env_file(tmp_path, 'PREFIXD_GROUP_HOSTS=["127.0.0.1",'))
