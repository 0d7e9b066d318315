"""`hf-bdlm bench`: the power-law fit, tables and plots on synthetic records, the longest-context search with a fake
probe, argument errors, and tiny real runs of the command (each measurement a torchrun launch). The smallest run of
the modes study (csbp at P = 2 beside the single process, L = 256) runs from the installed wheel in
tests/package/test_installed_wheel.py, which checks its records and plots."""

import json
from pathlib import Path

import pytest

from hf_bdlm import cli
from hf_bdlm.benchmarks import report
from hf_bdlm.benchmarks.bench_command import parse_size
from hf_bdlm.benchmarks.max_context import search_max_context

MiB = 2**20


def _record(mode, P, L, transport="allgather", schedule="dual_end", step_s=1.0, **extra):
    single = mode == "single"
    rec = dict(mode=mode, transport=None if single else transport, schedule=None if single else schedule, P=P,
               C=1 if mode in ("bp", "single") else P, L=L, layers=1, window=None, steps=1, step_s=step_s,
               step_times=[step_s], tokens_per_s=L / step_s, peak_mem_bytes=L * 1000 // P,
               peak_rss_bytes=L * 1000 // P + 400 * MiB, bytes_per_step=0 if single else L * 512,
               bytes_by_name={}, comm_wait_s=0.01, comm_wait_fwd_s=0.004, comm_wait_bwd_s=0.006)
    rec.update(extra)
    return rec


def _modes_records(exponents=None):
    """Every variant the modes study runs at P = 2 and 4, with step time c * L ** exponent per mode."""
    exponents = exponents or dict(single=2.0, cp=1.6, bp=1.8, csbp=1.5)
    recs = []
    for L in (1024, 2048, 4096):
        recs.append(_record("single", 1, L, step_s=1e-6 * L ** exponents["single"]))
        for P in (2, 4):
            for mode, second in (("cp", "allgather"), ("cp", "ring"), ("csbp", "allgather"), ("csbp", "ring")):
                recs.append(_record(mode, P, L, transport=second, step_s=1e-6 * L ** exponents[mode] / P))
            for schedule in ("dual_end", "contiguous"):
                recs.append(_record("bp", P, L, schedule=schedule, step_s=1e-6 * L ** exponents["bp"] / P))
    return recs


# --- fit, tables ---------------------------------------------------------------------------------
def test_power_law_fit_recovers_a_known_exponent():
    lengths = [2048, 4096, 8192, 16384, 32768]
    exponent, prefactor = report.fit_power_law(lengths, [3e-7 * L**1.7 for L in lengths])
    assert exponent == pytest.approx(1.7, abs=1e-9) and prefactor == pytest.approx(3e-7, rel=1e-9)
    # +-3 % alternating noise moves the least-squares slope by less than 0.05.
    noisy = [3e-7 * L**1.7 * (1.03 if i % 2 else 0.97) for i, L in enumerate(lengths)]
    assert report.fit_power_law(lengths, noisy)[0] == pytest.approx(1.7, abs=0.05)


@pytest.mark.parametrize("lengths, values, message", [
    ([2048, 2048], [1.0, 2.0], "two distinct lengths"),
    ([2048, 4096], [1.0, 0.0], "positive finite"),
])
def test_power_law_fit_refuses_what_it_cannot_fit(lengths, values, message):
    with pytest.raises(ValueError, match=message):
        report.fit_power_law(lengths, values)


def test_growth_fits_one_exponent_per_variant_and_group_size():
    fits = report.growth_fits(_modes_records())
    by = {(f["variant"], f["P"]): f for f in fits}
    assert len(fits) == 1 + 2 * 6
    assert by[("single", 1)]["exponent"] == pytest.approx(2.0, abs=1e-9)
    for P in (2, 4):
        assert by[("csbp ring", P)]["exponent"] == pytest.approx(1.5, abs=1e-9)
        assert by[("bp contiguous", P)]["exponent"] == pytest.approx(1.8, abs=1e-9)
        assert by[("cp allgather", P)]["lengths"] == [1024, 2048, 4096]


def test_tables_list_every_record_and_the_errors():
    recs = _modes_records() + [dict(mode="csbp", transport="ring", schedule="dual_end", P=4, C=4, L=8192,
                                    error="Traceback ...\nRuntimeError: killed")]
    plain, md = report.modes_table(recs), report.modes_table(recs, markdown=True)
    assert len(md.splitlines()) == len(recs) + 2 and len(plain.splitlines()) == len(recs) + 2
    assert "RuntimeError: killed" in plain and "| csbp ring | 4 | 8192 | error |" in md
    growth = report.growth_table(report.growth_fits(_modes_records()), markdown=True)
    assert "| csbp allgather | 2 |" in growth and growth.splitlines()[0].endswith("| 1K | 2K | 4K | exponent |")


# --- plots ---------------------------------------------------------------------------------------
def _is_png(path: Path) -> bool:
    return path.stat().st_size > 5000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_are_written_for_every_study(tmp_path):
    recs = _modes_records()
    paths = report.plot_modes(recs, tmp_path)
    assert [p.name for p in paths] == ["modes_tokens_per_s.png", "modes_peak_memory.png",
                                       "modes_bytes_per_step.png", "modes_comm_wait.png"]
    paths.append(report.plot_growth(recs, report.growth_fits(recs), tmp_path))
    results = [dict(variant="single", mode="single", P=1, longest=2048, first_over=2560, probes=[(512, 1)],
                    peak_at_longest=200 * MiB),
               dict(variant="csbp allgather", mode="csbp", P=2, longest=4096, first_over=4608, probes=[(512, 1)],
                    peak_at_longest=210 * MiB)]
    paths.append(report.plot_max_context(results, 256 * MiB, tmp_path))
    attention = [dict(bench="attention", name=n, length=L, time_s=t * L / 1024, peak_mb=10.0)
                 for n, t in (("blockwise", 0.1), ("dense", 0.3)) for L in (1024, 2048)]
    attention += [dict(bench="step", name=n, length=L, time_s=t * L / 1024, peak_mb=10.0)
                  for n, t in (("ar_step", 0.5), ("bdlm_step", 0.8)) for L in (1024, 2048)]
    paths.append(report.plot_attention(attention, tmp_path))
    assert all(_is_png(p) for p in paths), [(p.name, p.stat().st_size) for p in paths]


def test_plot_modes_refuses_records_that_all_failed(tmp_path):
    with pytest.raises(ValueError, match="no successful parallel-mode record"):
        report.plot_modes([dict(mode="cp", P=2, L=1024, error="boom")], tmp_path)


# --- longest-context search ------------------------------------------------------------------------
def _brute_force(memory, cap, grid, limit):
    return max(L for L in range(grid, limit + 1, grid) if memory(L) <= cap)


@pytest.mark.parametrize("name, memory", [
    ("linear", lambda L: 20 * MiB + 90_000 * L),
    ("quadratic", lambda L: 5 * MiB + 40 * L + L * L // 3),
    ("jump", lambda L: 10 * MiB + 50_000 * L + (200 * MiB if L > 3000 else 0)),
])
def test_search_finds_the_exact_boundary(name, memory):
    grid, limit = 256, 65536
    for cap in [60 * MiB, 100 * MiB, 256 * MiB, 300 * MiB + 12345, 1000 * MiB]:
        calls = []
        found = search_max_context(lambda L: calls.append(L) or memory(L), cap, grid, start=grid, limit=limit)
        expected = _brute_force(memory, cap, grid, limit)
        assert found.longest == expected, (name, cap)
        assert found.first_over == expected + grid and memory(found.first_over) > cap
        assert [L for L, _ in found.probes] == calls and len(set(calls)) == len(calls)  # no length probed twice
        assert len(calls) <= 14, (name, cap, calls)  # log2(65536 / 256) = 8 bisections, plus the growth phase
        if name == "linear":  # the secant lands on the boundary in a few probes when memory is a line
            assert len(calls) <= 5, (cap, calls)


def test_search_stops_at_the_limit_when_everything_fits():
    found = search_max_context(lambda L: L, cap=10**9, grid=512, start=512, limit=8192)
    assert found.longest == 8192 and found.first_over is None
    assert max(L for L, _ in found.probes) == 8192


def test_search_errors_when_even_the_smallest_length_does_not_fit():
    message = r"L=512, needs 300.0 MiB per rank, above the cap of 256.0 MiB: raise --mem-cap"
    with pytest.raises(ValueError, match=message):
        search_max_context(lambda L: 300 * MiB, cap=256 * MiB, grid=512, start=512, limit=8192)


def test_search_refuses_lengths_off_the_grid():
    with pytest.raises(ValueError, match="multiples of grid=512"):
        search_max_context(lambda L: 0, cap=1, grid=512, start=500, limit=8192)


# --- command line --------------------------------------------------------------------------------
def test_parse_size_units():
    assert parse_size("256MiB") == 256 * MiB and parse_size("2GiB") == 2 * 2**30 and parse_size("1.5kb") == 1500
    assert parse_size("4096") == 4096


@pytest.mark.parametrize("argv, message", [
    (["--mem-cap", "2XB"], "argument --mem-cap: '2XB' is not a size"),
    (["--mem-cap", "0MiB"], "the size must be positive"),
    (["--lengths", "0"], "argument --lengths: '0': must be a positive integer"),
    (["--only", "speed"], "argument --only: invalid choice: 'speed'"),
])
def test_bench_argument_errors_exit_2_naming_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "1000"], "--lengths 1000: every length must be a multiple of 512"),
    (["--nprocs", "2", "--lengths", "1024", "1100"], "--lengths 1100: every length must be a multiple of 256"),
    (["--nprocs", "1"], "--nprocs 1: group sizes are at least 2"),
    (["--growth-lengths", "2048"], "the exponent fit needs at least two distinct lengths"),
    (["--max-context-limit", "256"], "--max-context-limit 256: must be at least the search grid 512"),
    (["--min-time", "-1"], "--min-time -1.0: must be 0 (a fixed --steps) or a positive number of seconds"),
    (["--steps", "2"], "--steps=2: a timed comparison needs at least 3 timed steps"),
    (["--link", "nvlink"], "--link nvlink: unknown link; the named links are h100-nvlink"),
    (["--link", "none", "h200-ib"], "several links run the baselines study once per link"),
    (["--only", "baselines", "--link", "h200-ib", "h200-ib"], "a link is named twice"),
])
def test_bench_bad_values_are_refused_before_anything_runs(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["bench", "--out", str(out), *argv]) == 2
    assert message in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("steps, min_time, warmup, timed", [
    (2, 0.0, 0.1, 2),  # no --min-time: the fixed count
    (2, 5.0, 0.5, 10),  # short steps: enough to fill 5 s
    (2, 5.0, 0.3, 10),  # ... at most 10
    (2, 5.0, 1.3, 4),
    (2, 5.0, 12.0, 2),  # long steps: never fewer than --steps
])
def test_short_steps_are_timed_more_often(steps, min_time, warmup, timed):
    from hf_bdlm.benchmarks.parallel_modes import timed_steps

    assert timed_steps(steps, min_time, warmup) == timed


@pytest.mark.parametrize("first, launches", [(1.0, 3), (3.0, 1)])
def test_short_configurations_keep_the_median_of_three_launches(first, launches, monkeypatch, tmp_path):
    import argparse

    from hf_bdlm.benchmarks import parallel_modes

    steps = iter([first, 0.6, 1.4])
    monkeypatch.setattr(parallel_modes, "_launch_once", lambda *a, **k: dict(mode="cp", step_s=next(steps)))
    rec = parallel_modes.launch("cp", 2, 1024, argparse.Namespace(min_time=5.0), tmp_path)
    if launches == 3:  # 1.0 s < 5 s / 2: launched three times, the median launch kept
        assert rec == dict(mode="cp", step_s=1.0, launch_step_s=[0.6, 1.0, 1.4])
    else:
        assert rec == dict(mode="cp", step_s=3.0)


def test_modes_comparison_gives_csbps_speed_up_or_a_tie_from_the_timed_steps():
    recs = [_record("single", 1, 2048, step_s=4.0, step_times=[4.1, 4.0, 3.9]),
            _record("csbp", 2, 2048, step_s=2.0, step_times=[2.0, 1.9, 2.2]),
            _record("cp", 2, 2048, step_s=2.1, step_times=[2.1, 2.0, 2.3]),  # overlaps csbp's range
            _record("cp", 2, 2048, transport="ring", step_s=9.0, step_times=[9.0, 9.0, 9.0]),  # not compared
            _record("bp", 2, 2048, schedule="dual_end", step_s=3.0, step_times=[3.0, 3.1, 2.9]),
            _record("bp", 2, 2048, schedule="contiguous", step_s=2.8, step_times=[2.8, 2.7, 2.9])]
    md = report.modes_comparison_table(recs, markdown=True)
    # vs bp: the faster schedule (contiguous, 2.8 s); vs single: 4.0 / 2.0
    assert "| 2 | 2K | 2.000 [1.900-2.200] | tie (1.05x) | - | 1.40x | 2.00x |" in md
    assert "| 2 | 2048 | 2.000 [1.900-2.200] |" in report.modes_table(recs, markdown=True)


def test_link_table_gives_the_rate_that_scaled_each_launch_and_the_bytes_charged():
    link = {"name": "h200-ib", "bytes_per_s": 5.0e6, "latency_s": 0.16, "element_bytes": 2, "scale": 8000.0,
            "compute_rate": {"flops_per_s": 6.8e10, "processes_per_core": 2.0}}
    rec = _record("csbp", 4, 16384, link=link, bytes_per_step=4 * MiB, wire_bytes_per_step=2 * MiB, model="sliding")
    md = report.link_table([rec], markdown=True)
    # GPU-equivalent step: 1.0 s here over the scale 8000 = 0.125 ms; a record of before the row links: per launch
    assert ("| h200-ib (sliding) | csbp allgather | 4 | 16K | 68.0 | 2 | 8000 | 5.00 | 160.0 | 4.0 | 2.0 | 0.12 | "
            "per launch |") in md
    rec["link"] = dict(link, measured="once per row")
    assert "| 0.12 | once per row |" in report.link_table([rec], markdown=True)


def test_report_only_needs_results_to_report(tmp_path, capsys):
    assert cli.main(["bench", "--report-only", "--out", str(tmp_path)]) == 2
    assert "holds none of parallel_modes.json" in capsys.readouterr().err


def test_report_only_redraws_plots_and_markdown_from_the_json(tmp_path, capsys):
    recs = _modes_records()
    (tmp_path / "parallel_modes.json").write_text(json.dumps(recs))
    (tmp_path / "growth.json").write_text(json.dumps(dict(layers=1, records=recs, fits=report.growth_fits(recs))))
    assert cli.main(["bench", "--report-only", "--out", str(tmp_path), "--markdown"]) == 0
    md = (tmp_path / "summary.md").read_text()
    assert "| csbp ring | 4 | 4096 |" in md and "| bp contiguous | 2 |" in md
    assert all(_is_png(tmp_path / n) for n in ("modes_tokens_per_s.png", "modes_comm_wait.png", "growth.png"))
    assert "--- summary.md ---" in capsys.readouterr().out


def test_report_of_a_study_where_everything_failed_lists_the_errors_without_plots(tmp_path):
    failed = [dict(mode="csbp", transport="allgather", schedule="dual_end", P=2, C=2, L=1024, layers=1,
                   error="Traceback ...\nMemoryError: killed")]
    (tmp_path / "parallel_modes.json").write_text(json.dumps(failed))
    assert cli.main(["bench", "--report-only", "--out", str(tmp_path)]) == 0
    assert "MemoryError: killed" in (tmp_path / "summary.md").read_text()
    assert not list(tmp_path.glob("*.png"))


# --- the baselines study: csbp against both CP baselines ------------------------------------------------------------
def test_baselines_table_gives_csbps_speedup_over_each_baseline():
    from hf_bdlm.benchmarks import baselines

    def timed(*steps):
        return dict(step_s=sorted(steps)[1], step_times=list(steps))

    recs = [_record("csbp", 4, 8192, model="dense", attention_imbalance=1.0, **timed(1.9, 2.0, 2.1)),
            _record("cp", 4, 8192, model="dense", attention_imbalance=1.0, cp_layout="balanced", **timed(2.5, 2.4, 2.6)),
            _record("cp", 4, 8192, model="dense", attention_imbalance=1.37, cp_layout="paper", **timed(2.0, 3.0, 3.1)),
            _record("bp", 4, 8192, model="dense", **timed(4.0, 3.9, 4.2)),
            _record("csbp", 4, 8192, step_s=1.0, model="dense", link={"name": "h200-ib", "bytes_per_s": 1e6,
                                                                       "latency_s": 0.1})]
    rows = baselines.rows(recs)
    plain = next(r for r in rows if r["link"] is None)
    over = {m: (c.ratio, c.tie) for m, c in plain["csbp_over"].items()}
    # The paper's CP's slowest step (2.0 s) falls inside csbp's range: a tie, whatever its median says.
    assert over == {"cp": (pytest.approx(1.25), False), "cp-paper": (pytest.approx(1.5), True),
                    "bp": (pytest.approx(2.0), False)}
    linked = next(r for r in rows if r["link"] == "h200-ib")
    assert linked["csbp_over"] == {"cp": None, "cp-paper": None, "bp": None}  # nothing to compare with yet
    md = baselines.table(recs, markdown=True)
    assert ("| none | dense | 4 | 8K | 2.00 [1.90-2.10] | 2.50 [2.40-2.60] | 3.00 [2.00-3.10] | 4.00 [3.90-4.20] | "
            "tie (1.50x) | 1.25x | 2.00x |") in md
    assert "1.00/1.00/1.37" in md


@pytest.mark.distributed
def test_baselines_study_runs_the_papers_cp_beside_csbp(tmp_path, capsys):
    """The command (in this process, as above): csbp and the paper's CP baseline at L = 256, P = 2, each layout its
    own launch; a second run adds its layout."""
    out = tmp_path / "bench"
    common = ["bench", "--only", "baselines", "--baseline-lengths", "256", "--baseline-nprocs", "2",
              "--baseline-models", "dense", "--steps", "3", "--min-time", "0", "--no-calibrate", "--out", str(out)]
    for layouts in (["csbp", "cp-paper"], ["cp"]):
        code = cli.main(common + ["--baseline-layouts", *layouts])
        stdout, stderr = capsys.readouterr()
        assert code == 0, stdout[-2000:] + stderr[-2000:]
    records = json.loads((out / "baselines.json").read_text())
    by = {(r["mode"], r.get("cp_layout")): r for r in records}
    assert set(by) == {("csbp", "balanced"), ("cp", "paper"), ("cp", "balanced")}
    paper, cp, csbp = by[("cp", "paper")], by[("cp", "balanced")], by[("csbp", "balanced")]
    # docs/design.md §3: cp (either layout) receives (P-1)/P * 2 (K, V) * 2L * H_kv * d * 4 bytes per layer forward,
    # as much backward; 2 layers. csbp half of it.
    assert paper["bytes_per_step"] == cp["bytes_per_step"] == 2 * 2 * (1 / 2 * 2 * 512 * 2 * 32 * 4)
    assert csbp["bytes_per_step"] * 2 == cp["bytes_per_step"]
    assert paper["attention_imbalance"] == pytest.approx(1.2) and cp["attention_imbalance"] == 1.0  # 4 blocks
    assert "CSBP against both CP baselines" in (out / "summary.md").read_text()


def test_baselines_through_a_named_link_measure_once_per_row_and_give_every_layout_that_link(monkeypatch, tmp_path):
    """Each (model, P, L) row measures its link once, before its first layout, and every layout of the row is
    launched with that link (launches replaced by a stub that records what each was given)."""
    from hf_bdlm.benchmarks import baselines, parallel_modes
    from hf_bdlm.parallel.emulated_link import LinkModel

    measured, launched = [], []

    def measure(name, P, layers, tmp, timeout, window=None, full_every=None):
        measured.append((name, P, layers, window))
        return LinkModel(1e6 * len(measured), 0.1, name, 2, dict(scale=1000.0, measured="once per row"))

    def launch(layout, P, L, args, tmp, transport, schedule):
        launched.append((layout, P, L, args.link, args.link_record))
        return dict(mode=layout, P=P, L=L, step_s=1.0, step_times=[1.0] * 3, comm_wait_s=0.0,
                    link=args.link_record)

    monkeypatch.setattr(parallel_modes, "measure_row_link", measure)
    monkeypatch.setattr(parallel_modes, "launch", launch)
    monkeypatch.setattr(baselines, "attention_imbalance", lambda *a: 1.0)
    baselines.run_study(["dense", "sliding"], [2, 4], [256], 3, 60, link="h200-ib", out=tmp_path / "b.json",
                        log=lambda *a: None, layouts=("csbp", "cp"))
    assert measured == [("h200-ib", 2, 2, None), ("h200-ib", 4, 2, None), ("h200-ib", 2, 6, 1024),
                        ("h200-ib", 4, 6, 1024)]
    assert len(launched) == 8
    for row in range(4):  # both layouts of a row: no named link to re-measure, the row's link record
        (_, *_, n1, r1), (_, *_, n2, r2) = launched[2 * row:2 * row + 2]
        assert n1 is None and n2 is None and r1 == r2 and r1["bytes_per_s"] == 1e6 * (row + 1)


@pytest.mark.distributed
def test_a_rows_link_is_measured_by_its_ranks_together_and_read_back_by_a_launch(tmp_path):
    """The real measurement: P = 2 ranks measure the rate together; a launch's ``--link-file`` gives it back."""
    import argparse

    from hf_bdlm.benchmarks import parallel_modes

    link = parallel_modes.measure_row_link("h200-ib", 2, 2, tmp_path, timeout=300)
    rec = link.as_record()
    assert rec["measured"] == "once per row" and rec["compute_rate"]["processes"] == 2
    assert rec["bytes_per_s"] == pytest.approx(rec["cluster_bytes_per_s"] / rec["scale"])
    assert rec["latency_s"] == pytest.approx(rec["cluster_latency_s"] * rec["scale"])
    (tmp_path / "link.json").write_text(json.dumps(rec))
    again = parallel_modes._link(argparse.Namespace(link_file=str(tmp_path / "link.json"), link="h200-ib"))
    assert again.as_record() == rec


@pytest.mark.parametrize("extra, measured", [([], [(6, [2, 4])]), (["--no-calibrate"], []), (["--quick"], [])])
def test_baselines_measure_the_planners_figures_beside_their_records(extra, measured, monkeypatch, tmp_path):
    """The full preset measures cpu_rates.json into the records' folder before the study (for the first model's
    layers and the study's group sizes), where hf-bdlm plan --validate reads it; --no-calibrate and --quick do not."""
    from hf_bdlm.benchmarks import baselines, suite

    calls, order = [], []
    monkeypatch.setattr(suite, "measure_planner_figures",
                        lambda out, layers, counts: calls.append((out, layers, sorted(counts))) or order.append("rates"))
    monkeypatch.setattr(baselines, "run_study", lambda *a, **k: order.append("study") or [])
    args = ["bench", "--only", "baselines", "--baseline-models", "sliding", "dense", "--baseline-nprocs", "2", "4",
            "--baseline-lengths", "512", "--out", str(tmp_path)] + extra
    suite.run_baselines(suite.resolve(cli.build_parser().parse_args(args)))
    assert [(layers, counts) for _, layers, counts in calls] == measured
    assert all(out == tmp_path for out, _, _ in calls)
    assert order == ["rates"] * len(measured) + ["study"]  # measured before the launches


def test_a_crashed_launch_runs_once_more_and_keeps_its_error(monkeypatch, tmp_path):
    from hf_bdlm.benchmarks import parallel_modes

    results = iter([dict(mode="cp", error="gloo: Connection reset by peer"), dict(mode="cp", step_s=1.0)])
    monkeypatch.setattr(parallel_modes, "_launch_once", lambda *a, **k: next(results))
    args = parallel_modes.launch_args(1, 1, 60.0)
    rec = parallel_modes.launch("cp", 2, 256, args, tmp_path)
    assert rec["step_s"] == 1.0 and rec["retried_after_error"] == "gloo: Connection reset by peer"
    calls = []
    monkeypatch.setattr(parallel_modes, "_launch_once",
                        lambda *a, **k: calls.append(1) or dict(mode="cp", error="timed out after 60.0s"))
    assert parallel_modes.launch("cp", 2, 256, args, tmp_path)["error"].startswith("timed out") and len(calls) == 1
