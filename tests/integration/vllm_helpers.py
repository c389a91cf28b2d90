"""What the vLLM end-to-end tests share: the single-pair cluster a module starts once (its
router too), the official client's calls, token ids from the answers, waits, prompt text and
reading a server's /metrics."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import openai
from openai import OpenAI

from pdxfer import BootstrapServer
from pdxfer.serving.procs import Proc
from pdxfer.serving.vllm.local_model import CORPUS, build_model
from pdxfer.serving.vllm.servers import VllmServer, read_stats, start_all

MAX_TOKENS = 12
CLIENT_TIMEOUT_S = 120.0
"""The official client's deadline for one request (a module whose waits must outlast long
machine stalls passes its own ``timeout``)."""


class Cluster:
    """A bootstrap server, one ``vllm serve`` prefill and one decode loading
    ``PdxferConnector``, and a colocated vLLM (same model, no connector) as the reference:
    what the single-pair modules share. A module subclasses it to say only what differs: its
    instance names and how its prefill and decode are made (``prefill_server`` and
    ``decode_server``, started, not waited for); its ``cluster`` fixture is ``serve``."""

    prefill_instance: ClassVar[str]
    decode_instance: ClassVar[str]
    prefill: VllmServer
    decode: VllmServer
    ref: VllmServer

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model = build_model(tmp / "model", "small")
        self.boot = BootstrapServer("127.0.0.1", 0).start()
        self.p_stats, self.d_stats = tmp / "p.json", tmp / "d.json"

    def prefill_server(self, port: int | None = None) -> VllmServer:
        raise NotImplementedError

    def decode_server(self, port: int | None = None) -> VllmServer:
        raise NotImplementedError

    def p(self) -> dict[str, Any]:
        return read_stats(self.p_stats)

    def d(self) -> dict[str, Any]:
        return read_stats(self.d_stats)

    def restart_prefill(self) -> None:
        """A new prefill on the old one's port (the old one was killed), ready."""
        self.prefill = self.prefill_server(port=self.prefill.port)
        self.prefill.wait_ready()

    def restart_decode(self) -> None:
        """The decode stopped (gracefully) and a new one on its port, ready."""
        self.decode.stop()
        self.decode = self.decode_server(port=self.decode.port)
        self.decode.wait_ready()

    def router(
        self,
        name: str = "router",
        *more: str,
        prefill_url: str | None = None,
        instance: str | None = None,
        env: dict[str, str] | None = None,
    ) -> Proc:
        """``pdxfer router --engine vllm`` in front of the pair (or of ``prefill_url``
        registered as ``instance``), as users run it."""
        return Proc(
            name,
            [
                "router",
                "--engine",
                "vllm",
                "--port",
                "0",
                "--prefill",
                f"{prefill_url or self.prefill.url},{self.boot.address},"
                f"{instance or self.prefill_instance}",
                "--decode",
                f"{self.decode.url},{self.decode_instance}",
                *more,
            ],
            timeout=180,
            env=env,
        )


C = TypeVar("C", bound=Cluster)


def serve(c: C) -> Iterator[C]:
    """A module's ``cluster`` fixture: the three servers started together and yielded, then
    stopped (whichever were made, by pid) with the bootstrap server, even after a failure."""
    try:
        c.prefill = c.prefill_server()
        c.decode = c.decode_server()
        c.ref = VllmServer("colocated", c.model, c.tmp)
        start_all([c.prefill, c.decode, c.ref])
        yield c
    finally:
        for name in ("prefill", "decode", "ref"):
            srv = getattr(c, name, None)
            if srv is not None:
                srv.stop()
        c.boot.stop()


def front_door(c: Cluster) -> Iterator[str]:
    """A module's ``front_door`` fixture: the pair's router, its URL yielded."""
    router = c.router()
    try:
        yield router.url
    finally:
        router.stop()


def token_ids(choice: Any, body: Any) -> list[int]:
    """vLLM answers ``token_ids`` on the choice (``return_token_ids``); pdxfer's router in
    its ``pdxfer`` extension."""
    ids = getattr(choice, "token_ids", None)
    if ids is None:
        ids = (body.model_extra or {}).get("pdxfer", {}).get("token_ids")
    assert ids is not None, "no token ids in the answer"
    return list(ids)


def client(url: str, timeout: float = CLIENT_TIMEOUT_S) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)


def complete(
    url: str,
    prompt: str | list[int],
    timeout: float = CLIENT_TIMEOUT_S,
    max_tokens: int = MAX_TOKENS,
    **kw: Any,
) -> list[int]:
    r = client(url, timeout).completions.create(
        model="llama",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True, **kw.pop("extra", {})},
        **kw,
    )
    return token_ids(r.choices[0], r)


def right_or_clean_error(
    url: str, prompt: str | list[int], stream: bool, want: list[int], exact: bool = True
) -> str:
    """One request's verdict: ``ok`` (colocated tokens) or ``error`` (an OpenAI-shaped error
    status with a JSON body). Wrong tokens, a stream cut short (no final chunk) or an error
    inside a started stream fail the test. ``exact=False`` (a bf16 model whose tokens change
    with the batch it is computed in): a full answer of other tokens is ``other``, for the
    caller to account for."""
    try:
        got = stream_ids(url, prompt) if stream else complete(url, prompt)
    except openai.APIStatusError as e:
        assert isinstance(e.body, dict) and e.body.get("message"), (
            f"an error without an OpenAI JSON body: {e.status_code} {e.body!r}"
        )
        return "error"
    if not exact and got != want and len(got) == len(want):
        return "other"
    assert got == want, f"{'stream' if stream else 'plain'} {str(prompt)[:40]!r}: {got} != {want}"
    return "ok"


def chat_stream(url: str, text: str, timeout: float = CLIENT_TIMEOUT_S) -> tuple[str, list[int]]:
    stream = client(url, timeout).chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": text}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    out, ids = "", []
    for chunk in stream:
        if chunk.choices:
            out += chunk.choices[0].delta.content or ""
            ids += list(getattr(chunk.choices[0], "token_ids", None) or [])
        ext = (chunk.model_extra or {}).get("pdxfer")
        if ext:  # the router's last chunk of a choice carries all its ids
            ids = list(ext["token_ids"])
    return out, ids


def ref_chat(url: str, text: str, timeout: float = CLIENT_TIMEOUT_S) -> tuple[str, list[int]]:
    r = client(url, timeout).chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": text}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    return r.choices[0].message.content or "", list(r.choices[0].token_ids)  # type: ignore[attr-defined]


def logged(proc: Proc, word: str) -> list[str]:
    """For a failure's message: the lines of ``proc``'s log holding ``word`` (none when it
    keeps no log)."""
    log = proc.log
    lines = log.read_text(errors="replace").splitlines() if log and log.exists() else []
    return [ln for ln in lines if word in ln]


def wait(what: str, cond: Any, timeout: float = 120.0, show: Any = None) -> None:
    """Until ``cond()``: returns at the event; the bound only ends a hang (vLLM on a loaded
    machine takes its time). On a timeout the failure shows ``show()`` (the state waited on)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= end:
            raise AssertionError(
                f"timed out waiting for {what}" + (f": {show()}" if show is not None else "")
            )
        time.sleep(0.1)


WORDS = CORPUS.split()


def text(start: int, n: int) -> str:
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))


def kv_usage(server: VllmServer) -> float:
    return metric(server, "vllm:kv_cache_usage_perc")


def metric(server: VllmServer, name: str, label: str = "") -> float:
    """A metric's value in a server's /metrics (summed over its labels; only the series
    whose labels include ``label``, e.g. ``finished_reason="length"``, when given)."""
    vals = [
        float(line.rsplit(" ", 1)[1])
        for line in server.metrics_text().splitlines()
        if line.startswith((name + "{", name + " ")) and label in line.split("}")[0]
    ]
    assert vals, f"no {name} {label} in {server.url}/metrics"
    return sum(vals)


def stream_ids(url: str, prompt: str | list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """A streamed completion through the official client; the router's last chunk carries
    every token id of the choice."""
    ids: list[int] = []
    for chunk in client(url).completions.create(
        model="llama",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    ):
        ext = (chunk.model_extra or {}).get("pdxfer")
        if ext:
            ids = list(ext["token_ids"])
    return ids


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a vLLM server's engine core and TP workers)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])  # noqa: SIM115
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


@contextlib.contextmanager
def stacks_if_slow(
    servers: Sequence[VllmServer], out: Path, after_s: float = 60.0, every_s: float = 30.0
) -> Iterator[list[Path]]:
    """While the body runs past ``after_s``, every ``every_s`` the Python stacks of each
    server's processes (py-spy, where installed: the ``bench`` extra) go to ``out``; the
    files are named in the list yielded. Diagnostics only: what a slow request was waiting
    on, thread by thread (which one held the GIL), as a failure's evidence."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    files: list[Path] = []
    done = threading.Event()

    def run() -> None:
        if not os.path.exists(spy) or done.wait(after_s):
            return
        n = 0
        while not done.is_set():
            for s in servers:
                if not s.alive():
                    continue
                for pid in process_tree(s.pid):
                    f = out / f"{s.name}-{pid}-stacks-{n}.txt"
                    with open(f, "w") as fh:
                        subprocess.run(
                            [spy, "dump", "--pid", str(pid)],
                            stdout=fh,
                            stderr=subprocess.STDOUT,
                            timeout=20,
                            check=False,
                        )
                    files.append(f)
            n += 1
            done.wait(every_s)

    t = threading.Thread(target=run, name="stacks-if-slow", daemon=True)
    t.start()
    try:
        yield files
    finally:
        done.set()
        t.join(timeout=30)


def token_prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids drawn from ``seed`` in the small models' ordinary vocabulary (no
    specials)."""
    rng = random.Random(seed)
    return [rng.randrange(300, 1000) for _ in range(n)]


def prompt_logprobs(url: str, p: list[int], salt: str) -> list[Any]:
    """vLLM's log-probability of each prompt token, computed afresh (``salt``: none of the
    prefix cache's blocks, whoever computed them)."""
    r = client(url).completions.create(
        model="llama",
        prompt=p,
        max_tokens=1,
        temperature=0,
        extra_body={"prompt_logprobs": 0, "cache_salt": salt},
    )
    return list(r.choices[0].model_extra["prompt_logprobs"])


def rows_alike(url: str, lengths: Iterable[int]) -> bool:
    """Whether the server at ``url`` computes a prompt's first tokens alike served alone and
    with one token more, for prompts of each of ``lengths`` (their prompt logprobs equal):
    then its one-token step over a held prefix is what a decode computes from moved KV. Not
    so without AMX for vLLM's bf16 MLA, which computes a prompt in one step whose rows change
    with the step's length."""
    for i, n in enumerate(lengths):
        head = token_prompt(n - 1, 900 + i)
        alone = prompt_logprobs(url, head, "alone")
        more = prompt_logprobs(url, [*head, head[0]], "more")
        if alone != more[: len(head)]:
            return False
    return True


UNBOUND = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
"""The environment of a server with several worker processes (TP or DP ranks) on this
2-core host: unbound, one OpenMP thread each. vLLM's CPU worker otherwise binds each rank's
threads to the cores of "its" NUMA node, the same cores for every rank on a one-node host,
and the ranks' spinning OpenMP threads starve every other process there (a DP rank went up
to 224 s without CPU: docs/vllm.md#data-parallel)."""
