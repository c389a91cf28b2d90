"""A server forks from the preloaded process only where vLLM's import could not have seen a
difference: in a variable it read or wrote, one a scan it made looks for, one a native library
reads at load (but a positive OpenMP thread count, which the child applies itself); and any
difference at all once an unknown module walked the environment."""

from __future__ import annotations

from types import SimpleNamespace

from pdxfer.serving.vllm.forked import _differing, netns_split


def _differs(pre: SimpleNamespace, env: dict[str, str]) -> bool:
    return bool(_differing(pre, env))


BEFORE = {"VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "2", "HOME": "/root"}


def pre(everything: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        BEFORE=BEFORE,
        READ={"VLLM_LOGGING_LEVEL", "HOME", "VLLM_SERVER_DEV_MODE"},
        WRITTEN={"TORCHINDUCTOR_CACHE_DIR"},
        SCANNED={"TQDM_"},
        EVERYTHING=everything,
    )


def test_a_variable_the_import_never_saw_forks() -> None:
    assert not _differs(pre(), dict(BEFORE))
    assert not _differs(pre(), {**BEFORE, "PDXFER_FAULTS": "corrupt=1", "FOO": "1"})


def test_a_variable_the_import_read_wrote_or_scanned_for_runs_the_plain_command() -> None:
    assert _differs(pre(), {**BEFORE, "VLLM_LOGGING_LEVEL": "INFO"})
    assert _differs(pre(), {**BEFORE, "VLLM_SERVER_DEV_MODE": "1"})  # read, absent before
    assert _differs(pre(), {k: v for k, v in BEFORE.items() if k != "HOME"})  # removed
    assert _differs(pre(), {**BEFORE, "TORCHINDUCTOR_CACHE_DIR": "/elsewhere"})
    assert _differs(pre(), {**BEFORE, "TQDM_DISABLE": "1"})


def test_a_variable_native_libraries_read_at_load_runs_the_plain_command() -> None:
    assert _differs(pre(), {**BEFORE, "OMP_NUM_THREADS": "all"})
    assert _differs(pre(), {**BEFORE, "OMP_NUM_THREADS": "0"})
    assert _differs(pre(), {k: v for k, v in BEFORE.items() if k != "OMP_NUM_THREADS"})
    assert _differs(pre(), {**BEFORE, "OMP_PROC_BIND": "true"})
    assert _differs(pre(), {**BEFORE, "PYTHONPATH": "/shim"})
    assert _differs(pre(), {**BEFORE, "LD_PRELOAD": "libtcmalloc.so"})


def test_a_thread_count_the_child_applies_itself_forks_unless_the_import_read_it() -> None:
    assert not _differs(pre(), {**BEFORE, "OMP_NUM_THREADS": "1"})
    read = pre()
    read.READ = {*read.READ, "OMP_NUM_THREADS"}
    assert _differs(read, {**BEFORE, "OMP_NUM_THREADS": "1"})


def test_after_an_unknown_walk_of_the_environment_any_difference_counts() -> None:
    assert _differs(pre(everything=True), {**BEFORE, "FOO": "1"})
    assert not _differs(pre(everything=True), dict(BEFORE))


def test_only_ip_netns_exec_names_a_namespace_to_fork_into() -> None:
    cmd = ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert netns_split(["ip", "netns", "exec", "h0", *cmd]) == ("h0", cmd)
    assert netns_split(cmd) == (None, cmd)
    assert netns_split(["ip", "netns", "exec", "h0"]) == (None, ["ip", "netns", "exec", "h0"])
    assert netns_split(["sudo", *cmd]) == (None, ["sudo", *cmd])
