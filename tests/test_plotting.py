"""Run labels, the difference panel and the one-line errors of ``scripts/plot.py``; the demo
table's missing cells and its agreement with the README."""

import json
import math
import pathlib
import re
import runpy
import struct

import pytest

from gift_jax.apps.demo import demo_config, describe_mode, format_table
from gift_jax.apps.plotting import (
    difference_table,
    difference_to,
    path_labels,
    plot_runs,
    smooth,
    unique_labels,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(workdir: pathlib.Path, losses, evals=()) -> pathlib.Path:
    """A fake training workdir with a metrics.jsonl of train (and eval) losses."""
    workdir.mkdir(parents=True)
    with (workdir / "metrics.jsonl").open("w") as f:
        for step, loss in losses:
            f.write(json.dumps({"step": step, "loss": loss}) + "\n")
        for step, loss in evals:
            f.write(json.dumps({"step": step, "eval/loss": loss}) + "\n")
    return workdir


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_labels_are_the_shortest_distinguishing_suffix():
    assert path_labels(["runs/a/fp8", "runs/b/fp8", "runs/b/gift"]) == ["a/fp8", "b/fp8", "gift"]
    assert path_labels(["/x/run", "/y/x/run"]) == ["/x/run", "y/x/run"]  # a whole path
    assert path_labels(["runs/fp8", "runs/fp8/"]) == ["fp8", "fp8 (2)"]  # the same run twice
    assert unique_labels(["a", "b", "a", "a"]) == ["a", "b", "a (2)", "a (3)"]


def test_smoothed_difference_to_the_reference():
    ref = [(1, 5.0), (2, 4.0), (3, 3.0)]
    assert difference_to(ref, [(1, 5.5), (3, 2.0), (4, 1.0)]) == [(1, 0.5), (3, -1.0)]
    assert smooth([0.0, 3.0, 0.0, 3.0], 3) == [1.5, 1.0, 2.0, 1.5]
    assert smooth([1.0, 2.0], 1) == [1.0, 2.0]


def test_plot_script_draws_runs_sharing_a_folder_name(tmp_path, capsys, monkeypatch):
    a = _run(tmp_path / "a" / "fp8", [(1, 5.0), (2, 4.0)], [(2, 4.1)])
    b = _run(tmp_path / "b" / "fp8", [(1, 5.1), (2, 4.2)], [(2, 4.3)])
    drawn = {}
    import gift_jax.apps.plotting as plotting

    real = plotting.plot_runs

    def spy(runs, out_png, title="", **kwargs):
        drawn["runs"] = list(runs)
        return real(runs, out_png, title, **kwargs)

    monkeypatch.setattr(plotting, "plot_runs", spy)
    main = runpy.run_path(str(ROOT / "scripts" / "plot.py"))["main"]
    out = tmp_path / "loss.png"
    assert main([str(a), str(b), "--out", str(out), "--reference", "a/fp8"]) == 0
    assert drawn["runs"] == [("a/fp8", str(a)), ("b/fp8", str(b))]
    assert _png_size(out)[1] == 2 * 4.5 * 120  # two panels: the curves and the difference
    table = capsys.readouterr().out
    assert "| b/fp8 | 2.00e-01 | 4.300000 | +2.00e-01 |" in table  # max |Δ train|, Δ eval
    assert "| a/fp8 | 0.00e+00 | 4.100000 | +0.00e+00 |" in table


def test_difference_table_refuses_a_label_given_twice(tmp_path):
    """Two runs under one label would be one line (the last run's): an error instead."""
    a = _run(tmp_path / "a", [(1, 5.0)])
    b = _run(tmp_path / "b", [(1, 5.5)])
    with pytest.raises(ValueError, match=r"labels \['fp8'\] are given to more than one run"):
        difference_table([("fp8", a), ("fp8", b)], "fp8")
    with pytest.raises(ValueError, match=r"reference='fp32' is not a run label"):
        difference_table([("fp8", a)], "fp32")
    assert "| fp8 (2) | 5.00e-01 |" in difference_table(
        list(zip(unique_labels(["fp8", "fp8"]), [a, b], strict=True)), "fp8")


def test_plot_script_missing_directory_is_one_line(tmp_path, capsys):
    main = runpy.run_path(str(ROOT / "scripts" / "plot.py"))["main"]
    rc = main([str(tmp_path / "nope"), "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and "nope" in err[0]
    assert not (tmp_path / "x.png").exists()


def test_plot_without_reference_is_one_panel(tmp_path):
    a = _run(tmp_path / "fp32", [(1, 5.0), (2, 4.0)])
    png = plot_runs({"fp32": a}, tmp_path / "one.png", reference="fp32")
    assert _png_size(png)[1] == 4.5 * 120


# ---- the demo table -------------------------------------------------------------------------


def _readme_demo_table() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("### Demo"):]
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| mode |"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return lines[start:end]


def test_demo_table_prints_a_dash_for_missing_values():
    rows = [{"mode": "fp8", "eval_loss": 2.5, "final_train_loss": 2.4, "wire_vs_fp32": 0.25,
             "roundtrip_rel_l2": 0.035, "roundtrip_whitened": float("nan"),
             "tokens_per_s": 4000.4}]
    table = format_table(rows).splitlines()
    assert table[-1] == "| fp8 | 2.5000 | 2.4000 | 0.250 | 3.50e-02 | – | 4000 |"
    assert "nan" not in "\n".join(table)


def test_readme_demo_table_is_what_the_demo_prints():
    """The README's table, read back into rows, formats to itself: labels and the ``–`` of
    missing cells are the command's, the numbers are the recorded run's."""
    lines = _readme_demo_table()
    tiny = ROOT / "configs" / "tiny.py"
    rows = []
    for line in lines[2:]:
        label, *cells = [c.strip() for c in line.strip("|").split("|")]
        mode = label.split(" ")[0]
        values = [float("nan") if c == "–" else float(c) for c in cells]
        row = dict(zip(["eval_loss", "final_train_loss", "wire_vs_fp32", "roundtrip_rel_l2",
                        "roundtrip_whitened", "tokens_per_s"], values, strict=True))
        row.update(mode=mode, label=describe_mode(mode, demo_config(mode, 100, tiny)))
        rows.append(row)
    assert [r["mode"] for r in rows] == ["fp32", "fp8", "gift_fp8", "plumage"]
    assert format_table(rows).splitlines() == lines
    assert any(math.isnan(r["roundtrip_whitened"]) for r in rows)
    assert not re.search(r"\bnan\b", "\n".join(lines))


def test_demo_config_short_runs_keep_warmup_inside_the_run():
    tiny = ROOT / "configs" / "tiny.py"
    for steps in (1, 2, 100):
        config = demo_config("fp32", steps, tiny)
        assert config.optimizer.warmup_steps < steps
    with pytest.raises(ValueError, match="demo mode"):
        demo_config("int4", 10, tiny)
