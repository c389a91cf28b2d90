"""Each setting's default and help are written once, on its dataclass field.

The CLI flags and the vLLM connector's keys that set an endpoint setting are generated from
``pdxfer.endpoint_settings()``; no other module may restate such a default (a dataclass field,
a parameter or an ``add_argument`` of the same name with a literal), and every flag and key
has a help text.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

from pdxfer import endpoint_settings
from pdxfer.cli import build_parser, pass_through_parsers
from pdxfer.config import ENV_VARS, Knobs
from pdxfer.integrations.vllm import config as connector
from pdxfer.serving.cli_args import add_worker_args, flag_of
from pdxfer.setting import settings_of

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
    return (isinstance(node, ast.Constant) and default not in TRIVIAL
            and type(node.value) is type(default) and node.value == default)


def _restated(path: Path) -> list[str]:
    """Defaults ``path`` restates for an endpoint setting: the same literal under the setting's
    name (a field or a parameter), or any default for one of its flags."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(ROOT.parent)}:{getattr(node, 'lineno', 0)}"
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and _same(node.target.id, node.value)):
            out.append(f"{where} field {node.target.id} = {node.value.value!r}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            f = node.args
            args = f.posonlyargs + f.args
            pairs = list(zip(args[len(args) - len(f.defaults):], f.defaults))
            pairs += [(a, d) for a, d in zip(f.kwonlyargs, f.kw_defaults) if d]
            out += [f"{where} parameter {a.arg}={d.value!r}" for a, d in pairs
                    if _same(a.arg, d)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "add_argument" and node.args
              and isinstance(node.args[0], ast.Constant) and node.args[0].value in FLAGS
              and any(k.arg == "default" for k in node.keywords)):
            out.append(f"{where} flag {node.args[0].value} with its own default")
    return out


def test_each_default_is_written_once() -> None:
    bad = [hit for p in ROOT.rglob("*.py") for hit in _restated(p)]
    assert not bad, "defaults written outside their field:\n" + "\n".join(bad)


def test_the_check_sees_a_restated_default(tmp_path: Path) -> None:
    """What the walk above must catch (else it could not fail)."""
    src = ROOT / "restated_example.py"
    src.write_text("class C:\n    bootstrap_timeout_s: float = 30.0\n\n"
                   "def f(heartbeat_s=0.5): ...\n\n"
                   "ap.add_argument('--transfer-timeout', type=float, default=60.0)\n")
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
    assert not [s.name for s in (*SETTINGS.values(), *settings_of(Knobs).values())
                if not s.help.strip()]
    assert not [v.name for v in ENV_VARS if not v.help.strip()]
