"""bench/gpu/measured_table.py on small fake tables: which measured norm lands on
which Gavel job, what the mapped table keeps of Gavel's, the prior comparison and
bad input. No database."""

from __future__ import annotations

import csv
import json
from typing import TYPE_CHECKING, Any

import pytest

from bench.gpu import measured_table as mt
from scheduler.policy.interference import DEFAULT_BUSY, Knowledge, Model, Profile
from scheduler.sim.colocation import read_colocation

if TYPE_CHECKING:
    from pathlib import Path

FCN, VGG, RN50, LSTM, TRF = (
    "FCN (batch size 8)",
    "VGG-19 (batch size 32)",
    "ResNet-50 (batch size 64)",
    "LSTM (batch size 20)",
    "Transformer (batch size 32)",
)
# solo busy fractions: Transformer is the nearest to the simulator's DEFAULT_BUSY
SOLO = {FCN: (0.95, 9000), VGG: (0.99, 7000), RN50: (0.9, 12000), LSTM: (0.6, 3000),
        TRF: (0.85, 6000)}  # fmt: skip


def pair(a: str, b: str, na: float, nb: float, **kw: Any) -> dict[str, Any]:
    """A row of Gavel's pair format, isolated 10 and 20 steps/s unless given."""
    ia, ib = kw.pop("iso", (10.0, 20.0))
    row = {
        "worker_type": "h200", "gpu_type": "h200", "consolidated": 1, "job_a": a,
        "scale_factor_a": 1, "job_b": b, "scale_factor_b": 1, "isolated_a": ia,
        "isolated_b": ib, "colocated_a": na * ia, "colocated_b": nb * ib,
        "norm_a": na, "norm_b": nb, "combined_norm": na + nb, "feasible": 1,
        "n_at_isolated": 0,
    }  # fmt: skip
    row.update(kw)
    return row


def write(path: Path, rows: list[dict[str, Any]], columns: Any = None) -> Path:
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns or list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def gavel(tmp_path: Path, *rows: dict[str, Any]) -> Path:
    base = {"worker_type": "p100", "gpu_type": "p100"}
    return write(tmp_path / "gavel.csv", [{**r, **base} for r in rows])


def measured(tmp_path: Path, *rows: dict[str, Any]) -> Path:
    d = tmp_path / "measured"
    d.mkdir(exist_ok=True)
    write(d / mt.PAIRS_FILE, list(rows))
    solo = [
        {"workload": w, "busy_fraction": b, "memory_mib": m, "power_w": 250}
        for w, (b, m) in SOLO.items()
    ]
    write(d / mt.SOLO_FILE, solo)
    return d


def mapped(tmp_path: Path, d: Path, g: Path) -> tuple[list[dict[str, str]], Any]:
    out = tmp_path / "mapped.csv"
    summary = mt.to_p100(d, g, out)
    with out.open() as fh:
        return list(csv.DictReader(fh)), summary


def test_each_gavel_job_gets_its_own_familys_norm(tmp_path: Path) -> None:
    # measured with ResNet-50 as job_a; Gavel has LM first in one row, ResNet first
    # in the other: each Gavel job must get its mapped family's slowdown
    d = measured(tmp_path, pair(RN50, LSTM, 0.3, 0.9))
    g = gavel(
        tmp_path,
        pair("LM (batch size 5)", "ResNet-50 (batch size 16)", 0.5, 0.5, iso=(80, 9)),
        pair("ResNet-18 (batch size 32)", "LM (batch size 40)", 0.5, 0.5, iso=(30, 40)),
    )
    rows, summary = mapped(tmp_path, d, g)
    assert [(r["norm_a"], r["norm_b"]) for r in rows] == [
        ("0.9000", "0.3000"),
        ("0.3000", "0.9000"),
    ]
    assert float(rows[0]["colocated_a"]) == pytest.approx(0.9 * 80)
    assert float(rows[1]["colocated_b"]) == pytest.approx(0.9 * 40)
    assert summary["taken"] == 2 and summary["kept"] == 0
    table = read_colocation(str(tmp_path / "mapped.csv"))
    assert table.norm("p100", "LM (batch size 5)", "ResNet-50 (batch size 16)") == (
        pytest.approx(0.9)
    )


def test_both_orders_are_averaged(tmp_path: Path) -> None:
    d = measured(tmp_path, pair(RN50, LSTM, 0.3, 0.9), pair(LSTM, RN50, 0.7, 0.5))
    g = gavel(tmp_path, pair("ResNet-50 (batch size 32)", "LM (batch size 10)", 1, 1))
    rows, summary = mapped(tmp_path, d, g)
    assert (rows[0]["norm_a"], rows[0]["norm_b"]) == ("0.4000", "0.8000")
    assert rows[0]["combined_norm"] == "1.2000"
    assert summary["taken_both_orders"] == 1


def test_infeasible_measurement_makes_the_gavel_pair_infeasible(
    tmp_path: Path,
) -> None:
    # out of memory in one order of the two measured: the pair does not fit
    d = measured(tmp_path, pair(FCN, TRF, 0, 0, feasible=0), pair(TRF, FCN, 0.5, 0.6))
    g = gavel(tmp_path, pair("CycleGAN", "Transformer (batch size 16)", 0.6, 0.7))
    rows, summary = mapped(tmp_path, d, g)
    assert rows[0]["feasible"] == "0"
    assert float(rows[0]["colocated_a"]) == float(rows[0]["colocated_b"]) == 0
    table = read_colocation(str(tmp_path / "mapped.csv"))
    assert table.norm("p100", "CycleGAN", "Transformer (batch size 16)") is None
    assert summary["taken_infeasible"] == 1


def test_pairs_not_measured_keep_gavels_row_and_are_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = measured(tmp_path, pair(RN50, LSTM, 0.3, 0.9))
    same = pair("ResNet-18 (batch size 16)", "ResNet-50 (batch size 32)", 0.47, 0.41)
    unmeasured = pair("CycleGAN", "LM (batch size 20)", 0.6, 0.55)
    g = gavel(tmp_path, same, unmeasured, pair("A3C", "LM (batch size 5)", 1, 1))
    k80 = {**pair("A3C", "LM (batch size 5)", 1, 1), "worker_type": "k80"}
    with g.open("a", newline="") as fh:  # other GPU types are left out
        csv.DictWriter(fh, fieldnames=list(k80)).writerow(k80)
    out = tmp_path / "mapped.csv"
    code = mt.main(["to-p100", "--measured-dir", str(d), "--gavel-pairs", str(g),
                    "--out", str(out), "--summary", str(tmp_path / "s.json")])  # fmt: skip
    assert code == 0
    with out.open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 3
    assert (rows[0]["norm_a"], rows[0]["colocated_b"]) == ("0.47", str(0.41 * 20))
    assert (rows[1]["norm_a"], rows[1]["norm_b"]) == ("0.6", "0.55")
    summary = json.loads((tmp_path / "s.json").read_text())
    assert (summary["taken"], summary["kept"]) == (0, 3)
    # A3C maps by busy fraction (to Transformer here), never measured beside LSTM
    assert summary["mapping"]["A3C"] == "Transformer"
    assert summary["missing_family_pairs"] == [
        "FCN + LSTM",
        "LSTM + Transformer",
        "ResNet-50 + ResNet-50",
    ]
    assert summary["unused_measured_pairs"] == ["LSTM + ResNet-50"]
    assert "ResNet-50 + ResNet-50" in capsys.readouterr().err


def test_busy_mapping_is_nearest_to_the_simulators_busy_fraction() -> None:
    solo = {f: mt.Solo(f, b, 1) for f, b in zip(mt.SUITE, (0.95, 0.99, 0.9, 0.6, 0.74))}
    assert mt.SIM_BUSY == DEFAULT_BUSY
    # |0.74 - 0.8| = 0.06 beats ResNet-50's 0.10 and LSTM's 0.20
    assert mt.family_map({"Recommendation", "A3C"}, solo) == {
        "A3C": "Transformer",
        "Recommendation": "Transformer",
    }
    solo["LSTM"] = mt.Solo("LSTM", 0.82, 1)
    assert mt.family_map({"A3C"}, solo) == {"A3C": "LSTM"}


def test_prior_is_the_interference_models_prior_for_the_ordered_pair(
    tmp_path: Path,
) -> None:
    d = measured(tmp_path, pair(LSTM, RN50, 0.4, 0.8), pair(FCN, TRF, 0, 0, feasible=0))
    rows, summary = mt.prior(d)
    got = {(r["job"], r["beside"]): r for r in rows}
    assert set(got) == {(LSTM, RN50), (RN50, LSTM)}  # the infeasible pair has none
    r = got[(LSTM, RN50)]
    want = (
        Model(Knowledge())
        .estimate(Profile(LSTM, 3000, 0.6), Profile(RN50, 12000, 0.9))
        .slowdown
    )
    # the small LSTM suffers more beside the big ResNet: 1 + u_a u_b 2 m_b/(m_a+m_b)
    assert want == pytest.approx(1 + 0.6 * 0.9 * 2 * 12000 / 15000)
    assert r["predicted"] == pytest.approx(want)
    assert r["measured"] == pytest.approx(1 / 0.4)
    assert r["error"] == pytest.approx(want - 2.5)
    assert r["rel_error"] == pytest.approx(want / 2.5 - 1)
    assert got[(RN50, LSTM)]["measured"] == pytest.approx(1 / 0.8)
    assert summary["infeasible"] == ["FCN + Transformer"]
    assert summary["bias"] == "under-predicts"
    assert (
        summary["worst"][0] == "LSTM (batch size 20) beside ResNet-50 (batch size 64)"
    )


def test_replay_runs_both_tables_on_each_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Real replays of colo-b (its first 60 jobs), each with the table it names."""
    d = measured(tmp_path, pair(RN50, LSTM, 0.3, 0.9))
    g = gavel(tmp_path, pair("ResNet-50 (batch size 32)", "LM (batch size 10)", 1, 1))
    out = tmp_path / "replay"
    code = mt.main(["replay", "--measured-dir", str(d), "--gavel-pairs", str(g),
                    "--seeds", "0-1", "--out-dir", str(out), "--max-jobs", "60"])  # fmt: skip
    assert code == 0
    tables = {"gavel": str(g.resolve()), "h200": str((out / mt.MAPPED_FILE).resolve())}
    figures = json.loads((out / "replay.json").read_text())["figures"]
    for seed in (0, 1):
        for label, table in tables.items():
            run = json.loads((out / f"colo_b_{label}_{seed}.json").read_text())
            assert (run["seed"], run["options"]["colocation"]) == (seed, table)
            assert figures[f"{seed}/{label}"]["avg_jct_s"] == run["avg_jct_s"]
    printed = capsys.readouterr().out
    assert (out / "replay.md").read_text() in printed
    assert printed.count("| avg JCT (h) |") == 1


@pytest.mark.parametrize(
    ("what", "needle"),
    [
        ("missing column", "missing column(s) norm_b"),
        ("unknown measured family", "family 'BERT' is not a suite one"),
        ("unmapped Gavel family", "Gavel family 'GPT' maps to no suite workload"),
        ("feasible with no norm", "a feasible pair needs norm_a, norm_b > 0"),
    ],
)
def test_bad_input_exits_naming_the_problem(
    tmp_path: Path, what: str, needle: str
) -> None:
    rows = [pair(RN50, LSTM, 0.3, 0.9)]
    gavel_job = "LM (batch size 5)"
    if what == "missing column":
        rows = [{k: v for k, v in rows[0].items() if k != "norm_b"}]
    elif what == "unknown measured family":
        rows.append(pair("BERT (batch size 8)", LSTM, 0.5, 0.5))
    elif what == "unmapped Gavel family":
        gavel_job = "GPT (batch size 4)"
    else:
        rows.append(pair(FCN, LSTM, 0, 0.5))
    d = measured(tmp_path, *rows)
    g = gavel(tmp_path, pair(gavel_job, "ResNet-50 (batch size 16)", 1, 1))
    with pytest.raises(SystemExit) as exc:
        mt.main(["to-p100", "--measured-dir", str(d), "--gavel-pairs", str(g),
                 "--out", str(tmp_path / "m.csv")])  # fmt: skip
    assert isinstance(exc.value.code, str)  # exit status 1, the message on stderr
    assert needle in exc.value.code
    if what != "unmapped Gavel family":
        assert mt.PAIRS_FILE in exc.value.code
    assert not (tmp_path / "m.csv").exists()
