"""report.md's server-timing table: present when runs carry the server's timing, with only the
columns some run has; absent otherwise; rows read back from summary.csv read as written."""

from __future__ import annotations

from pdserve.loadgen.report import write_report


def _row(**extra) -> dict:
    row = {"cluster": None, "policy": "least-loaded", "bandwidth_gbps": None, "dataset": "in512-out64", "rate": 2.0,
           "num_ok": 4, "num_requests": 4, "ttft_p50": 0.05, "interrupted": False}
    row.update(extra)
    return row


def test_the_table_has_the_timed_columns_only(tmp_path):
    path = tmp_path / "report.md"
    timed = _row(srv_timed=4, srv_local=4, srv_place_p50=0.0001, srv_queue_p50=0.007, srv_prefill_p50=0.0286,
                 srv_first_token_p50=0.0393, srv_first_text_p50=0.0454)
    write_report(path, name="t", rows=[timed, _row(dataset="untimed")], environment={}, plots=[], notes=[])
    text = path.read_text()
    assert "## Where TTFT went (server timing, p50 ms)" in text
    header = next(line for line in text.splitlines() if line.startswith("| policy | dataset | rate | timed"))
    assert header == ("| policy | dataset | rate | timed (local) | place | queue | prefill | first token "
                      "| first text | client TTFT |")
    assert "| least-loaded | in512-out64 | 2 | 4 (4) | 0.1 | 7.0 | 28.6 | 39.3 | 45.4 | 50.0 |" in text
    assert "untimed | 2 | " not in text.split("## Where TTFT went")[1]  # only timed runs get a row


def test_no_table_without_server_timing_and_csv_booleans_read_right(tmp_path):
    path = tmp_path / "report.md"
    write_report(path, name="t", rows=[_row(interrupted="False"), _row(interrupted="True", dataset="cut")],
                 environment={}, plots=[], notes=[])
    text = path.read_text()
    assert "Where TTFT went" not in text
    lines = text.splitlines()
    assert next(line for line in lines if "| in512-out64 |" in line).endswith("|  |")
    assert next(line for line in lines if "| cut |" in line).endswith("| interrupted |")


def test_plots_of_panels_without_data_draw_no_empty_legend(tmp_path):
    """A bandwidth that ran only lower rates has no line in the top-rate TTFT CDF: no legend, no warning."""
    import warnings

    from pdserve.loadgen.records import RequestRecord, write_jsonl
    from pdserve.loadgen.report import make_plots

    write_jsonl(tmp_path / "r.jsonl", [RequestRecord(index=0, request_id="a", scheduled_s=0.0, sent_s=0.0, ttft_s=0.1,
                                                     e2e_s=0.2, status=200)])
    rows = [{"dataset": "d", "policy": "p", "bandwidth_gbps": bw, "rate": rate, "num_requests": 1,
             "records_file": "r.jsonl", "slo_attainment": 1.0, "goodput": rate}
            for bw, rate in ((1.0, 1.0), (10.0, 2.0))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        written = make_plots(rows, tmp_path)
    assert sorted(p.name for p in written) == ["goodput_vs_bandwidth.png", "slo_attainment_vs_rate.png", "ttft_cdf.png"]
