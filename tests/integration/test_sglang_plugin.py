"""SGLang finds pdxfer through its own plugin loader, argument parser and ``get_kv_class``."""

from __future__ import annotations

from .sglang_helpers import run


def test_get_kv_class_returns_pdxfer_classes_for_every_class_type() -> None:
    r = run("check_registration.py")
    mod = "pdxfer.integrations.sglang.conn."
    assert r["classes"] == {
        "kvargs": "sglang.srt.disaggregation.base.conn.KVArgs",
        "manager": mod + "PdxferKVManager", "sender": mod + "PdxferKVSender",
        "receiver": mod + "PdxferKVReceiver", "bootstrap_server": mod + "PdxferKVBootstrapServer"}
    assert all(r["subclass"].values()), r["subclass"]  # SGLang's CommonKV* classes
    assert r["parsed"] == "pdxfer"  # --disaggregation-transfer-backend pdxfer parses
    assert r["queues_see_it"] == ["pdxfer", "pdxfer"]  # prefill.py and decode.py's binding
    assert r["fake"] == "FakeKVManager"  # other backends still resolve to SGLang's
    assert r["members"] == ["ascend", "fake", "mooncake", "mori", "nixl", "pdxfer"]
