"""The transfer benchmark's plot (throughput against request size) and Markdown table."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = out["bulk.curve"]
    mib = [r["bytes"] / 2**20 for r in curve]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, color in (("raw", "tab:gray"), ("pdxfer", "tab:blue")):
        med = [r[name]["median"] for r in curve]
        lo = [r[name]["median"] - r[name]["min"] for r in curve]
        hi = [r[name]["max"] - r[name]["median"] for r in curve]
        label = "raw Mooncake batch_transfer_sync_write" if name == "raw" else "pdxfer"
        ax.errorbar(mib, med, yerr=[lo, hi], marker="o", capsize=3, label=label, color=color)
    ax.axhline(
        out["limits.socket_gbps"],
        ls="--",
        color="tab:red",
        label=f"plain TCP socket, 1 connection ({out['limits.socket_gbps']:.2f})",
    )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("request size (MiB; 128 KiB scattered pages, 64 buffers)")
    ax.set_ylabel("GB/s (median, min-max)")
    ax.set_title("KV transfer over Mooncake TCP, loopback, 2 vCPUs")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def table(o: dict[str, Any]) -> str:
    """The headline figures as a Markdown table (pasted into docs/performance.md)."""

    def f(k: str, nd: int = 2) -> str:
        v = o.get(k)
        return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))

    def mm(k: str) -> str:
        v = o.get(k)
        return f"{v[0]:.2f} - {v[1]:.2f}" if v else "-"

    rows = [
        ("bulk: raw Mooncake sync, GB/s", f("bulk.raw_gbps"), mm("bulk.raw_gbps_min_max")),
        (
            "bulk: pdxfer, first send to Success, GB/s",
            f("bulk.pdxfer_gbps"),
            mm("bulk.pdxfer_gbps_min_max"),
        ),
        (
            "bulk: pdxfer / raw (per interleaved pair)",
            f("bulk.ratio_vs_raw"),
            mm("bulk.ratio_vs_raw_min_max"),
        ),
        ("small: raw push, rooms/s", f("small.raw_rooms_per_s", 1), ""),
        ("small: pdxfer, rooms/s", f("small.pdxfer_rooms_per_s", 1), ""),
        ("small: rate ratio", f("small.rate_ratio_vs_baseline"), ""),
        (
            "small: p50 / p99 raw push, ms",
            f"{f('small.raw_p50_ms', 1)} / {f('small.raw_p99_ms', 1)}",
            "",
        ),
        (
            "small: p50 / p99 pdxfer, ms",
            f"{f('small.pdxfer_p50_ms', 1)} / {f('small.pdxfer_p99_ms', 1)}",
            "",
        ),
        ("small: p50 ratio", f("small.p50_ratio_vs_baseline"), ""),
        ("one 128-token request: pdxfer send() to Success, ms", f("small.serial_pdxfer_ms"), ""),
        (
            "one 128-token request: raw write in the baseline processes, ms",
            f("small.serial_raw_write_ms"),
            "",
        ),
        (
            "fixed cost per request (time to Success minus its raw write), ms",
            f("small.fixed_cost_ms"),
            " - ".join(f"{x:.2f}" for x in o.get("small.fixed_cost_ms_p25_p75", [])) + " (p25-p75)",
        ),
        (
            "same, against the baseline processes' raw write, ms",
            f("small.fixed_cost_vs_baseline_ms"),
            "",
        ),
        ("same, from the decode's request(), ms", f("small.fixed_cost_from_request_ms"), ""),
        (
            "entries equal runs x buffers (random / contiguous / half)",
            f"{o.get('entries.equal_to_runs')}",
            f"{f('entries.random.entries')} / "
            f"{f('entries.contiguous.entries')} / {f('entries.half_contiguous.entries')}",
        ),
        (
            "NIXL bulk GB/s / Mooncake TCP bulk GB/s (same run)",
            f"{f('nixl.bulk_gbps')} / {f('nixl.bulk_mooncake_gbps')}",
            "",
        ),
        (
            "NIXL / Mooncake bulk (per interleaved pair)",
            f("nixl.bulk_ratio_vs_mooncake"),
            mm("nixl.bulk_ratio_min_max"),
        ),
        (
            "fixed cost per request, NIXL / Mooncake, ms",
            f"{f('nixl.small_fixed_cost_ms')} / {f('nixl.small_fixed_cost_mooncake_ms')}",
            "",
        ),
        ("NIXL entries equal runs x buffers", f"{o.get('nixl.entries_equal_to_runs')}", ""),
        ("NIXL bulk as a fraction of memcpy", f("nixl.fraction_of_memcpy"), ""),
        (
            "NIXL bulk with UCX_TLS=tcp, GB/s / ratio to UCX's choice",
            f"{f('nixl.ucx_tls.tcp.bulk_gbps')} / {f('nixl.ucx_tls.tcp.ratio_vs_default')}",
            "",
        ),
        (
            "NIXL bulk on the posting thread alone, GB/s / ratio to the default",
            f"{f('nixl.one_thread.bulk_gbps')} / {f('nixl.one_thread.ratio_vs_default')}",
            "",
        ),
        (
            "idle pair, cores: NIXL / Mooncake",
            f"{f('nixl.idle_cpu_cores', 3)} / {f('nixl.idle_cpu_cores_mooncake', 3)}",
            "",
        ),
        ("memcpy, GB/s", f("limits.memcpy_gbps"), ""),
        (
            "TCP socket, 1 connection, GB/s",
            f("limits.socket_gbps"),
            mm("limits.socket_gbps_min_max"),
        ),
        (
            "raw / pdxfer as a fraction of the socket",
            f"{f('limits.raw_fraction_of_socket')} / {f('limits.pdxfer_fraction_of_socket')}",
            "",
        ),
        ("pdxfer CPU beyond the transport's, s per GB", f("cpu.seconds_per_gb", 3), ""),
    ]
    out = ["| figure | median | min - max |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    for k in sorted(o):
        if k.startswith(("hetero_tp.", "incremental.")):
            out.append(f"| {k} | {f(k)} | |")
    return "\n".join(out)


__all__ = ["plot", "table"]
