"""The collector's preflight, which `serve` runs itself, so that a collector started from Python (no command line)
is checked and locked down as `rankwatch collector` is: what an earlier collector left in a data directory open to
other users is made owner-only, the token is settled once (the file's read, or a given one checked), and a taken
port is refused before anything serves."""

import os
import socket
import stat

import duckdb
import pytest
from starlette.requests import Request

from collector.config import Config
from collector.server import Unstartable, preflight, serve
from rankwatch.agent.config import INGEST, TokenError
from tests.support.collectors import free_port

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these


@pytest.fixture
def owner_only_umask():
    """preflight sets the process's umask (collector/private.py): set back after each test."""
    umask = os.umask(0o022)
    yield
    os.umask(umask)


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_direct_serve_tightens_the_data_directory_before_it_refuses_a_taken_port(tmp_path, capsys, owner_only_umask):
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o755)
    db, token = data / "rankwatch.duckdb", data / "token"
    duckdb.connect(str(db)).close()
    token.write_text("a-token-written-by-hand-0123\n")
    for path in (db, token):
        path.chmod(0o644)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(Unstartable, match=f"cannot listen on 127.0.0.1:{taken.getsockname()[1]}"):
            serve(Config(db=db, port=taken.getsockname()[1]))
    assert (_mode(db), _mode(token)) == (0o600, 0o600)
    assert _mode(data) == 0o755  # a directory that exists is not the collector's to change: it says so instead
    assert f"{data} is open to other users (mode 755)" in capsys.readouterr().err


def test_preflight_settles_the_token_once(tmp_path, owner_only_umask):
    """No token given: the file beside the store, made on a first start (owner-only, in a directory of the
    collector's own); a given token too short to be a secret is refused before anything starts."""
    db = tmp_path / "new" / "rankwatch.duckdb"
    tokens = preflight(Config(db=db, port=free_port()))
    made = (db.parent / "token").read_text().strip()
    request = Request({"type": "http", "headers": [(b"authorization", f"Bearer {made}".encode())]})
    assert INGEST in tokens.scopes(request)
    assert (_mode(db.parent), _mode(db.parent / "token")) == (0o700, 0o600)
    with pytest.raises(TokenError, match="the token in --token or \\$RANKWATCH_TOKEN is 5 characters"):
        preflight(Config(db=db, port=free_port(), token="short"))
