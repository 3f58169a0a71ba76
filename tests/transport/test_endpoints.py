"""A sender's endpoint is its own: a second sender on the same ``ipc://`` path, a ``tcp://`` port
in use or an abstract ``ipc://@`` name in use is refused at bind with a RefitConfigError naming the
endpoint; the first sender keeps working. (libzmq alone would let a second ``ipc://`` bind unlink
the first sender's socket file and silently take its place.)"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading

import pytest
import torch

from refit_verify import RefitConfig
from refit_verify.errors import RefitConfigError
from refit_verify.transport import RefitReceiver, RefitSender

CFG = RefitConfig.build(mode="enforce", timeout_s=10.0)


def _refit_works(tx: RefitSender) -> None:
    """One verified refit through ``tx`` with a receiver thread: the endpoint still belongs to it."""
    out: dict = {}

    def run():
        try:
            with RefitReceiver(tx.endpoint, config=RefitConfig.build(timeout_s=10.0, connect_timeout_s=10.0)) as rx:
                out["result"] = rx.receive(lambda b: None)
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    report = tx.send([("w", torch.randn(16))])
    th.join(10)
    assert report.ok and report.verified == 1 and out["result"].ok, out


def test_second_sender_on_same_ipc_path_in_this_process_is_refused(tmp_path):
    ep = f"ipc://{tmp_path}/refit.sock"
    with RefitSender(config=CFG, endpoint=ep) as first:
        with pytest.raises(RefitConfigError) as ei:
            RefitSender(config=CFG, endpoint=ep)
        assert f"endpoint {ep} is already bound by another RefitSender" in str(ei.value)
        assert os.path.exists(f"{tmp_path}/refit.sock")
        _refit_works(first)
    assert not os.path.exists(f"{tmp_path}/refit.sock") and not os.path.exists(f"{tmp_path}/refit.sock.lock")
    with RefitSender(config=CFG, endpoint=ep) as again:  # released on close: the path is free again
        _refit_works(again)


def test_second_sender_in_another_process_is_refused(tmp_path):
    ep = f"ipc://{tmp_path}/refit.sock"
    code = ("import sys\nfrom refit_verify import RefitConfig\nfrom refit_verify.errors import RefitConfigError\n"
            "from refit_verify.transport import RefitSender\n"
            "try:\n    RefitSender(config=RefitConfig(mode='off'), endpoint=sys.argv[1])\n"
            "except RefitConfigError as e:\n    print('REFUSED', e)\n    sys.exit(3)\nprint('BOUND')\n")
    with RefitSender(config=CFG, endpoint=ep) as first:
        r = subprocess.run([sys.executable, "-c", code, ep], capture_output=True, text=True, timeout=120)
        assert r.returncode == 3, r.stdout + r.stderr
        assert r.stdout.startswith(f"REFUSED refit sender: endpoint {ep} is already bound by another RefitSender"), r.stdout
        _refit_works(first)


def test_a_foreign_listener_on_the_path_is_refused(tmp_path):
    """A process listening on the socket file without our lock (another program, an older
    refit-verify) is not unlinked and replaced either."""
    path = f"{tmp_path}/refit.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(1)
    try:
        with pytest.raises(RefitConfigError, match=f"endpoint ipc://{path} is in use: a process listens on {path}"):
            RefitSender(config=CFG, endpoint=f"ipc://{path}")
        assert os.path.exists(path)
    finally:
        s.close()


def test_a_stale_socket_file_of_a_dead_sender_is_taken_over(tmp_path):
    """A sender killed without cleanup leaves its socket file (and lock file) behind; nobody
    listens, nobody holds the lock: the next sender binds."""
    ep = f"ipc://{tmp_path}/refit.sock"
    code = "import os, sys\nfrom refit_verify import RefitConfig\nfrom refit_verify.transport import RefitSender\n" \
           "tx = RefitSender(config=RefitConfig(mode='off'), endpoint=sys.argv[1])\nos._exit(0)\n"
    r = subprocess.run([sys.executable, "-c", code, ep], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert os.path.exists(f"{tmp_path}/refit.sock") and os.path.exists(f"{tmp_path}/refit.sock.lock")
    with RefitSender(config=CFG, endpoint=ep) as tx:
        _refit_works(tx)


def test_tcp_port_in_use_is_refused():
    with RefitSender(config=CFG, endpoint="tcp://127.0.0.1:*") as first:
        ep = first.endpoint
        assert ep.startswith("tcp://127.0.0.1:")
        with pytest.raises(RefitConfigError) as ei:
            RefitSender(config=CFG, endpoint=ep)
        assert str(ei.value) == (f"refit sender: endpoint {ep} is already in use (another sender, or another program, "
                                 "is bound to it)")
        _refit_works(first)


def test_abstract_ipc_name_in_use_is_refused():
    ep = f"ipc://@refit-verify-test-{secrets.token_hex(6)}"
    with RefitSender(config=CFG, endpoint=ep) as first:
        with pytest.raises(RefitConfigError, match=f"endpoint {ep} is already in use"):
            RefitSender(config=CFG, endpoint=ep)
        _refit_works(first)


def test_unbindable_endpoint_is_a_config_error():
    with pytest.raises(RefitConfigError, match="cannot bind endpoint tcp://256.1.1.1:5"):
        RefitSender(config=CFG, endpoint="tcp://256.1.1.1:5")
