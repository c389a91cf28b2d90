"""Each setting's default and help are written once, on its dataclass field.

The CLI flags and the vLLM connector's keys that set an endpoint setting are generated from
``pdxfer.endpoint_settings()``; no other module may restate such a default (a dataclass field,
a parameter or an ``add_argument`` of the same name with a literal), and every flag and key
has a help text. The toy workers' and the router's flags come from the fields that consume
them (``WorkerConfig``, ``RouterSettings``, ``MediaPolicy``) the same way, and so do the
demos' own parsers (``DemoOptions``, ``VllmDemoOptions``, ``TransferDemoOptions``) and
``pdxfer demo``'s ``--engine`` pick (``CliOptions``); no parameter or field restates a serving
default (``ToyConfig``'s shape takes the toy worker's).
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from pdxfer import cli, endpoint_settings
from pdxfer.agents import transfer_demo
from pdxfer.agents.transfer_demo import TransferDemoOptions
from pdxfer.cli import CliOptions, build_parser, engine_pick, pass_through_parsers
from pdxfer.config import ENV_VARS, Knobs
from pdxfer.integrations.vllm import config as connector
from pdxfer.serving import cli_args
from pdxfer.serving.cli_args import add_worker_args, flag_of
from pdxfer.serving.router.media import MediaPolicy
from pdxfer.serving.router.settings import RouterSettings
from pdxfer.serving.toy import demo as toy_demo
from pdxfer.serving.toy.config import WorkerConfig
from pdxfer.serving.toy.demo import DemoOptions
from pdxfer.serving.toy.model import ToyConfig
from pdxfer.serving.vllm import demo as vllm_demo
from pdxfer.serving.vllm import local_model
from pdxfer.serving.vllm.demo import VllmDemoOptions
from pdxfer.setting import Setting, settings_of

ROOT = Path(__file__).resolve().parents[2] / "pdxfer"
OWN = ("host", "advertise", "bootstrap")
"""Addresses every server binds, advertises or registers at on its own (a router, a bootstrap
server, a store): each component's own setting, which happens to share an endpoint's name."""
SETTINGS = {n: s for n, s in endpoint_settings().items() if n not in OWN}
FLAGS = {flag_of(n): n for n in SETTINGS}
TRIVIAL = (None, "", 0, 1, False, True, ())
"""Values too common to call a restatement when another object has a field of the same name."""


def _same(name: str, node: ast.expr | None) -> bool:
    """``node`` is a literal equal to the setting ``name``'s (distinctive) default."""
    default = SETTINGS[name].default if name in SETTINGS else None
    return (
        isinstance(node, ast.Constant)
        and default not in TRIVIAL
        and type(node.value) is type(default)
        and node.value == default
    )


def _restated(path: Path) -> list[str]:
    """Defaults ``path`` restates for an endpoint setting: the same literal under the setting's
    name (a field or a parameter), or any default for one of its flags."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(ROOT.parent)}:{getattr(node, 'lineno', 0)}"
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and _same(node.target.id, node.value)
        ):
            out.append(f"{where} field {node.target.id} = {node.value.value!r}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            f = node.args
            args = f.posonlyargs + f.args
            pairs = list(zip(args[len(args) - len(f.defaults) :], f.defaults))
            pairs += [(a, d) for a, d in zip(f.kwonlyargs, f.kw_defaults) if d]
            out += [f"{where} parameter {a.arg}={d.value!r}" for a, d in pairs if _same(a.arg, d)]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in FLAGS
            and any(k.arg == "default" for k in node.keywords)
        ):
            out.append(f"{where} flag {node.args[0].value} with its own default")
    return out


def test_each_default_is_written_once() -> None:
    bad = [hit for p in ROOT.rglob("*.py") for hit in _restated(p)]
    assert not bad, "defaults written outside their field:\n" + "\n".join(bad)


def test_the_check_sees_a_restated_default(tmp_path: Path) -> None:
    """What the walk above must catch (else it could not fail)."""
    src = ROOT / "restated_example.py"
    src.write_text(
        "class C:\n    bootstrap_timeout_s: float = 30.0\n\n"
        "def f(heartbeat_s=0.5): ...\n\n"
        "ap.add_argument('--transfer-timeout', type=float, default=60.0)\n"
    )
    try:
        assert len(_restated(src)) == 3
    finally:
        src.unlink()


def test_generated_flags_and_keys_take_the_fields_default() -> None:
    ap = argparse.ArgumentParser()
    add_worker_args(ap, "decode")
    generated = [a for a in ap._actions if a.option_strings[0] in FLAGS]
    assert len(generated) >= 8
    for a in generated:
        assert a.default == SETTINGS[FLAGS[a.option_strings[0]]].default, a.option_strings
    for key, s in connector.ENDPOINT.items():
        assert connector.default(key) == s.default == endpoint_settings()[key].default


def _actions(ap: argparse.ArgumentParser) -> list[argparse.Action]:
    out = []
    for a in ap._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                out += _actions(sub)
        elif not isinstance(a, argparse._HelpAction):
            out.append(a)
    return out


def test_every_flag_key_and_setting_has_help() -> None:
    actions = _actions(build_parser())
    for p in pass_through_parsers().values():
        actions += _actions(p)
    assert len(actions) > 50
    assert not [a.option_strings or a.dest for a in actions if not (a.help or "").strip()]
    assert not [k for k in connector.KEYS if not connector.help_of(k).strip()]
    assert not [
        s.name for s in (*SETTINGS.values(), *settings_of(Knobs).values()) if not s.help.strip()
    ]
    assert not [v.name for v in ENV_VARS if not v.help.strip()]


CONSUMERS = {
    "prefill": (WorkerConfig,),
    "decode": (WorkerConfig,),
    "router": (RouterSettings, MediaPolicy),
    "bootstrap": (CliOptions,),
}
"""The dataclasses whose fields each serving command's flags are generated from (beside
``EndpointConfig``'s)."""


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _by_flag(*classes: type) -> dict[tuple[str, ...], Setting]:
    out = {}
    for known in (endpoint_settings(), *(settings_of(c) for c in classes)):
        out |= {s.flags or (flag_of(n),): s for n, s in known.items()}
    return out


def _expected_default(a: argparse.Action, s: Setting) -> object:
    if s.required:
        return None
    return list(s.default) if isinstance(a, argparse._AppendAction) else s.default


@pytest.mark.parametrize("command", sorted(CONSUMERS))
def test_serving_flags_are_generated_from_their_fields(command: str) -> None:
    """Every flag of ``pdxfer prefill``, ``decode``, ``router`` and ``bootstrap`` (and
    ``pdxfer``'s own) has the default and help of the field that consumes it: none is
    declared on its own."""
    fields_ = _by_flag(*CONSUMERS[command]) | {
        ("--log-level",): settings_of(CliOptions)["log_level"]
    }
    actions = [
        a
        for a in (*_subparser(command)._actions, *build_parser()._actions)
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
    ]
    assert len(actions) >= 5
    orphans = [a.option_strings for a in actions if tuple(a.option_strings) not in fields_]
    assert not orphans, f"flags of pdxfer {command} declared outside a field: {orphans}"
    for a in actions:
        s = fields_[tuple(a.option_strings)]
        assert a.default == _expected_default(a, s), (a.option_strings, a.default, s.default)
        assert a.help == s.help.replace("``", "").replace("%", "%%"), a.option_strings


def _literal_flag_args(path: Path) -> list[str]:
    """``add_argument`` calls in ``path`` that write a default or a help text themselves."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
        ):
            out += [
                f"{path.name}:{node.lineno} {k.arg}="
                for k in node.keywords
                if k.arg in ("default", "help") and not isinstance(k.value, ast.Name)
            ]
    return out


@pytest.mark.parametrize(
    "module", [cli_args, cli, toy_demo, vllm_demo, transfer_demo], ids=lambda m: m.__name__
)  # local_model: only its positional's help
def test_option_parsers_write_no_default_or_help(module: object) -> None:
    """The serving flags' module, ``pdxfer``'s dispatcher and the demos' own parsers leave
    every default and help text to a field."""
    assert not _literal_flag_args(Path(module.__file__))


PASS_THROUGH = {
    "demo": DemoOptions,
    "bench": DemoOptions,
    "demo --engine vllm": VllmDemoOptions,
    "transfer-demo": TransferDemoOptions,
}
"""The dataclass whose fields each self-parsing subcommand's flags are generated from."""
OTHERS = {
    "demo's --engine pick": (engine_pick, CliOptions),
    "python -m pdxfer.serving.vllm.local_model": (local_model.parser, local_model.BuildOptions),
}


@pytest.mark.parametrize("command", [*sorted(PASS_THROUGH), *OTHERS])
def test_demo_flags_are_generated_from_their_fields(command: str) -> None:
    """``pdxfer demo``, ``bench``, ``transfer-demo``, ``demo --engine vllm``, the
    ``--engine`` pick before them and the model builder's: every flag's default and help are
    its field's."""
    if command in PASS_THROUGH:
        ap, cls = pass_through_parsers()[command], PASS_THROUGH[command]
    else:
        make, cls = OTHERS[command]
        ap = make()
    known = {s.flags or (flag_of(n),): s for n, s in settings_of(cls).items()}
    actions = [
        a for a in ap._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]
    assert actions
    orphans = [a.option_strings for a in actions if tuple(a.option_strings) not in known]
    assert not orphans, f"flags of {command} declared outside a field: {orphans}"
    if command in PASS_THROUGH:  # and every field of theirs is a flag
        assert len(actions) == len(known)
    for a in actions:
        s = known[tuple(a.option_strings)]
        assert a.default == _expected_default(a, s), (a.option_strings, a.default, s.default)
        assert a.help == s.help.replace("``", "").replace("%", "%%"), a.option_strings


def test_the_flag_check_sees_a_literal(tmp_path: Path) -> None:
    src = tmp_path / "flags.py"
    src.write_text(
        "ap.add_argument('--pages', type=int, default=1024, help='KV pages')\n"
        "ap.add_argument(*flags, **(kw | over))\n"
    )
    assert len(_literal_flag_args(src)) == 2


def _serving_defaults() -> dict[str, list[object]]:
    out: dict[str, list[object]] = {}
    for cls in (WorkerConfig, RouterSettings, MediaPolicy):
        for n, s in settings_of(cls).items():
            if s.default not in TRIVIAL:
                out.setdefault(n, []).append(s.default)
    return out


def _restates_serving(path: Path, known: dict[str, list[object]]) -> list[str]:
    """Parameters and dataclass fields in ``path`` whose literal default equals a serving
    setting's of the same name."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        pairs: list[tuple[str, ast.expr]] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            f = node.args
            args = f.posonlyargs + f.args
            pairs = [(a.arg, d) for a, d in zip(args[len(args) - len(f.defaults) :], f.defaults)]
            pairs += [(a.arg, d) for a, d in zip(f.kwonlyargs, f.kw_defaults) if d]
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.value is not None
        ):
            pairs = [(node.target.id, node.value)]
        out += [
            f"{path.name}:{node.lineno} {n}={d.value!r}"
            for n, d in pairs
            if isinstance(d, ast.Constant) and d.value in known.get(n, ())
        ]
    return out


def test_no_parameter_or_field_restates_a_serving_default() -> None:
    """``Router(timeout_s=120.0)`` beside ``--timeout``'s 120.0 would be two copies, and so
    would ``ToyConfig.page_size = 16`` beside ``--page-size``'s 16."""
    known = _serving_defaults()
    bad = [hit for p in (ROOT / "serving").rglob("*.py") for hit in _restates_serving(p, known)]
    assert not bad, bad


def test_the_toy_model_takes_the_workers_shape_defaults() -> None:
    worker = settings_of(WorkerConfig)
    assert ToyConfig().page_size == worker["page_size"].default
    assert ToyConfig().max_seq_len == worker["max_seq_len"].default


def test_the_serving_check_sees_a_restated_field_and_parameter(tmp_path: Path) -> None:
    src = tmp_path / "restated.py"
    src.write_text(
        "class C:\n    page_size: int = 16\n    max_seq_len: int = 1024\n\n"
        "def f(timeout_s=120.0): ...\n"
    )
    assert len(_restates_serving(src, _serving_defaults())) == 3
