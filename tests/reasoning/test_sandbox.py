"""The code sandbox: every misbehaving program is a failed sample, and the host stays as it was."""

from __future__ import annotations

import os
import socket
import textwrap
from dataclasses import replace

import pytest

from multispec.reasoning import sandbox
from multispec.reasoning.sandbox import group_running, isolation, run_python


def run(program: str, **limits) -> sandbox.ExecutionResult:
    return run_python(textwrap.dedent(program), **limits)


def test_a_passing_program_passes():
    result = run("print('hello')")
    assert (result.passed, result.status, result.stdout) == (True, "passed", "hello\n")
    assert result.seconds < 5


def test_a_crash_is_a_failed_sample():
    result = run("raise ValueError('broken')")
    assert (result.passed, result.status) == (False, "failed")
    assert "ValueError: broken" in result.stderr


def test_infinite_loop_times_out_and_its_whole_group_is_killed():
    result = run("""
        import os, subprocess
        print(os.getpgid(0), flush=True)
        subprocess.Popen(["sleep", "60"])
        while True:
            pass
        """, timeout=1)
    assert result.status == "timeout" and not result.passed
    assert 1 <= result.seconds < 3
    assert not group_running(int(result.stdout.split()[0]))


@pytest.mark.skipif(not isolation().process_limit, reason="programs run as root here, which RLIMIT_NPROC exempts")
def test_fork_bomb_is_capped_by_the_process_limit():
    result = run("""
        import os
        print(os.getpgid(0), flush=True)
        while True:
            try:
                if os.fork() == 0:
                    print("forked", flush=True)
            except OSError:
                pass
        """, timeout=1.5, max_processes=6)
    assert result.status == "timeout" and not result.passed
    # The limit counts what the uid already runs, killed programs' zombies included; init may
    # reap one or two of those meanwhile, each freeing a slot. Uncapped, this loop forks thousands.
    assert 0 < result.stdout.count("forked") <= 6 + 2
    assert not group_running(int(result.stdout.split()[0]))


def test_allocating_10_gb_fails_without_harm():
    result = run("block = bytearray(10 * 1024 ** 3)", memory_mb=512)
    assert result.status == "failed" and "MemoryError" in result.stderr


def test_home_is_the_working_directory_and_is_removed_after():
    result = run("""
        import os, pathlib
        (pathlib.Path.home() / "notes.txt").write_text("kept inside")
        os.makedirs("locked/inner")
        os.chmod("locked", 0)
        print(os.getcwd())
        print(os.environ["HOME"])
        """)
    assert result.passed, result.stderr
    cwd, home = result.stdout.split()
    assert home == cwd and not os.path.exists(cwd)


@pytest.mark.skipif(isolation().user is None, reason="programs run as the caller, who may write to its own files")
def test_writing_outside_the_directory_is_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    result = run(f"open({str(target)!r}, 'w').write('out')")
    assert result.status == "failed" and "PermissionError" in result.stderr
    assert not target.exists()


@pytest.mark.parametrize("network", ["detected", "socket-guard"])
def test_sockets_cannot_reach_a_listening_server(network, monkeypatch):
    if network == "socket-guard":
        monkeypatch.setattr(sandbox, "_isolation", replace(isolation(), network="socket-guard"))
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        port = server.getsockname()[1]
        result = run(f"""
            import socket
            with socket.create_connection(("127.0.0.1", {port}), timeout=2) as connection:
                connection.sendall(b"leak")
            """)
        assert result.status == "failed"
        assert "Network is unreachable" in result.stderr or "network access is disabled" in result.stderr
        with pytest.raises(BlockingIOError):
            server.accept()


def test_socket_guard_still_allows_local_socket_pairs(monkeypatch):
    monkeypatch.setattr(sandbox, "_isolation", replace(isolation(), network="socket-guard"))
    result = run("""
        import socket
        a, b = socket.socketpair()
        a.sendall(b"x")
        print(b.recv(1).decode())
        """)
    assert result.passed and result.stdout == "x\n"


def test_parent_secrets_are_not_inherited(monkeypatch):
    monkeypatch.setenv("MULTISPEC_TEST_SECRET", "hunter2")
    result = run("import os; print(sorted(os.environ))")
    assert result.passed
    assert "hunter2" not in result.stdout and "MULTISPEC_TEST_SECRET" not in result.stdout


def test_output_is_capped_and_the_program_killed():
    result = run("""
        import sys
        while True:
            sys.stdout.write("x" * 1000)
        """, max_output_bytes=4096)
    assert result.status == "failed" and len(result.stdout) == 4096
    assert "output over 4096 bytes" in result.stderr


def test_leftover_children_do_not_hold_a_finished_program():
    result = run("""
        import subprocess
        subprocess.Popen(["sleep", "60"])
        print("done")
        """)
    assert result.passed and result.seconds < 3


@pytest.mark.parametrize("limits", [{"timeout": 0}, {"memory_mb": 1}, {"max_processes": 0},
                                    {"max_output_bytes": -1}])
def test_bad_limits_raise(limits):
    with pytest.raises(ValueError, match=next(iter(limits))):
        run_python("pass", **limits)


def test_a_program_that_cannot_start_is_an_error_not_an_exception(monkeypatch):
    monkeypatch.setattr(sandbox, "_isolation", replace(isolation(), python="/nonexistent/python3"))
    result = run("print('never')")
    assert (result.passed, result.status) == (False, "error") and "/nonexistent/python3" in result.stderr
