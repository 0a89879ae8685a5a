"""Quality report of a batch output file: did it work, and do the answers look sane?

Rules (all lengths are in characters of the answer text, so the report needs no tokenizer; token
counts from ``usage`` are shown beside them):

* **succeeded**: a record with no ``error`` and ``response.status_code == 200``; every other
  record is **failed**, counted per error type: ``error.code``, else the response body's
  ``error.code``, else its ``error.type``, else ``http_<status>``.
* Each choice of a succeeded record is one **output** (``choices[i].text`` or
  ``choices[i].message.content``); with ``n > 1`` an output is named ``custom_id#i``.
* **empty**: the answer is empty or only whitespace.
* **too short**: not empty, but fewer than ``SHORT_CHARS`` (5) characters after stripping whitespace.
* **exact duplicates**: non-empty outputs whose text is identical, character for character, to
  another output's; counted per output (a group of 3 equal answers counts 3) and per group.
* **length distribution**: p5 / p50 / p95 of the non-empty outputs' lengths (linear interpolation).
* **outliers**: non-empty outputs shorter than p50 / ``OUTLIER_FACTOR`` or longer than
  p50 * ``OUTLIER_FACTOR`` (4): a ratio rule, which suits length distributions (skewed, capped at
  ``max_tokens``) better than a symmetric IQR fence.
* A torn last line (an interrupted job) is skipped and counted as ``unreadable_lines``; when one
  id has several records, the last one counts (``duplicate_records`` says how many were superseded).
  Lines without an id are matched by their ``request_hash`` (as a resumed job matches them).
* With the job's input file: ``missing`` lists input ids without a record (lost, or not run
  yet) and ``extra`` lists records whose id is not in the input (foreign records).
* ``headline``: records per id, then the duplicated and foreign records, missing items and
  unreadable lines; the table's first line.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np

from celeris.batch.output import Key, RecordKeys, is_success

SHORT_CHARS = 5
OUTLIER_FACTOR = 4.0
MAX_LISTED = 20  # ids listed per category in the JSON report


def answer_texts(record: dict) -> list[str]:
    """The answer text of every choice in a record's response body (empty for failed records)."""
    body = (record.get("response") or {}).get("body") or {}
    texts = []
    for choice in body.get("choices") or []:
        if "message" in choice:
            texts.append((choice.get("message") or {}).get("content") or "")
        else:
            texts.append(choice.get("text") or "")
    return texts


def error_type(record: dict) -> str:
    error = record.get("error") or {}
    if error:
        return str(error.get("code") or "error")
    response = record.get("response") or {}
    body_error = (response.get("body") or {}).get("error") or {}
    return str(body_error.get("code") or body_error.get("type") or f"http_{response.get('status_code')}")


def record_name(record: dict) -> str:
    """How the report names a record: its custom_id, or ``<line N>`` for a line without an id."""
    cid = record.get("custom_id")
    return str(cid) if cid is not None else f"<line {record.get('line')}>"


def read_keyed_records(path: str | Path) -> tuple[dict[Key, dict], int, int]:
    """Last record per key (as a resumed job keys them), the number of superseded records, the number
    of unreadable lines."""
    records: dict[Key, dict] = {}
    keys = RecordKeys()
    superseded = unreadable = 0
    with open(path, "rb") as fh:
        for raw in fh:
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                unreadable += 1
                continue
            if not isinstance(record, dict):
                unreadable += 1
                continue
            key = keys(record)
            if key in records:
                superseded += 1
            records[key] = record
    return records, superseded, unreadable


def read_records(path: str | Path) -> tuple[dict[str, dict], int, int]:
    """Last record per id (named by ``record_name``), the number of superseded records, of unreadable lines."""
    records, superseded, unreadable = read_keyed_records(path)
    return {record_name(r): r for r in records.values()}, superseded, unreadable


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"min": None, "p5": None, "p50": None, "p95": None, "max": None, "mean": None}
    arr = np.asarray(values, dtype=np.float64)
    p5, p50, p95 = np.percentile(arr, [5, 50, 95])
    return {"min": float(arr.min()), "p5": float(p5), "p50": float(p50), "p95": float(p95), "max": float(arr.max()),
            "mean": round(float(arr.mean()), 2)}


def input_keys(path: str | Path) -> tuple[dict[Key, str], dict[int, Key]]:
    """The keys of a job's input lines with their names (``custom_id`` or ``<line N>``), and the keys of
    its id-less lines by line number (records written before request hashes name those by line)."""
    from celeris.batch.jobs import iter_items

    names: dict[Key, str] = {}
    line_keys: dict[int, Key] = {}
    for item in iter_items(path):
        names.setdefault(item.key, item.custom_id if item.custom_id is not None else f"<line {item.line_no}>")
        if item.custom_id is None:
            line_keys[item.line_no] = item.key
    return names, line_keys


def headline(report: dict) -> str:
    """One line: records per id, and the duplicated and foreign records (those a clean job has none of)."""
    parts = [f"{report['records'] + report['duplicate_records']} records for {report['records']} ids"]
    issues = []
    if report["duplicate_records"]:
        issues.append(f"{report['duplicate_records']} duplicated (an id recorded again; the last record counts)")
    if "extra" in report and report["extra"]["count"]:
        issues.append(f"{report['extra']['count']} foreign (id not in the input {report['input']})")
    if "missing" in report and report["missing"]["count"]:
        issues.append(f"{report['missing']['count']} input item(s) without a record")
    if report["unreadable_lines"]:
        issues.append(f"{report['unreadable_lines']} unreadable line(s)")
    if issues:
        parts.append("; ".join(issues))
    elif "extra" in report:
        parts.append("one record per input item, none duplicated or foreign")
    else:
        parts.append("none duplicated (give --input to check for foreign records)")
    return ": ".join(parts)


def duplicate_groups(outputs: list[tuple[str, str]]) -> tuple[list[tuple[str, list[str]]], dict[str, str]]:
    """Outputs with the same text: ([(sha1 of the text, [names])] for groups of 2 or more, largest first;
    {sha1: text})."""
    groups: dict[str, list[str]] = {}
    samples: dict[str, str] = {}
    for name, text in outputs:
        digest = hashlib.sha1(text.encode("utf-8")).hexdigest()
        groups.setdefault(digest, []).append(name)
        samples.setdefault(digest, text)
    return sorted((g for g in groups.items() if len(g[1]) > 1), key=lambda g: -len(g[1])), samples


def length_outliers(outputs: list[tuple[str, str]], p50: float | None
                    ) -> tuple[list[str], float | None, float | None]:
    """(names, low, high): the outputs whose length in characters lies outside [p50 / OUTLIER_FACTOR,
    p50 * OUTLIER_FACTOR]; none (and no bounds) without a median."""
    if not p50:
        return [], None, None
    low, high = p50 / OUTLIER_FACTOR, p50 * OUTLIER_FACTOR
    return [name for name, text in outputs if len(text) < low or len(text) > high], low, high


def build_report(path: str | Path, input_path: str | Path | None = None) -> dict:
    """The report of one output file as a JSON-ready dict (see the module doc for every rule)."""
    keyed, superseded, unreadable = read_keyed_records(path)
    wanted: dict[Key, str] | None = None
    if input_path is not None:
        wanted, line_keys = input_keys(input_path)
        keyed = {(line_keys.get(int(k[1]), k) if isinstance(k, tuple) and k[0] == "line" else k): r
                 for k, r in keyed.items()}
    records: dict[str, dict] = {}
    for k, r in keyed.items():
        name = wanted[k] if wanted and k in wanted else record_name(r)
        if name in records:  # two id-less records of one line number (the input changed in between)
            name = f"{name} #{len(records)}"
        records[name] = r
    errors: Counter[str] = Counter()
    finish: Counter[str] = Counter()
    outputs: list[tuple[str, str]] = []  # (output name, text)
    tokens: list[int] = []
    for key, record in records.items():
        if not is_success(record):
            errors[error_type(record)] += 1
            continue
        body = record["response"].get("body") or {}
        texts = answer_texts(record)
        for i, choice in enumerate(body.get("choices") or []):
            finish[str(choice.get("finish_reason"))] += 1
            outputs.append((key if len(texts) == 1 else f"{key}#{i}", texts[i]))
        usage = body.get("usage") or {}
        if len(texts) == 1 and isinstance(usage.get("completion_tokens"), int):
            tokens.append(usage["completion_tokens"])

    empty = [name for name, text in outputs if not text.strip()]
    short = [name for name, text in outputs if 0 < len(text.strip()) < SHORT_CHARS]
    nonempty = [(name, text) for name, text in outputs if text.strip()]
    lengths = [len(text) for _, text in nonempty]

    dup_groups, samples = duplicate_groups(nonempty)

    dist = percentiles(lengths)
    outliers, low, high = length_outliers(nonempty, dist["p50"])

    num_ok = len(records) - sum(errors.values())
    coverage = {}
    if wanted is not None:
        missing = [name for k, name in wanted.items() if k not in keyed]
        extra = [record_name(r) for k, r in keyed.items() if k not in wanted]
        coverage = {"input": str(input_path), "input_items": len(wanted),
                    "missing": {"count": len(missing), "ids": missing[:MAX_LISTED]},
                    "extra": {"count": len(extra), "ids": extra[:MAX_LISTED]}}
    report = {
        "file": str(path),
        **coverage,
        "records": len(records),
        "succeeded": num_ok,
        "failed": sum(errors.values()),
        "errors": dict(errors.most_common()),
        "duplicate_records": superseded,
        "unreadable_lines": unreadable,
        "outputs": len(outputs),
        "finish_reasons": dict(finish.most_common()),
        "empty_outputs": {"count": len(empty), "ids": empty[:MAX_LISTED]},
        "too_short_outputs": {"count": len(short), "ids": short[:MAX_LISTED], "rule": f"1-{SHORT_CHARS - 1} chars"},
        "duplicate_outputs": {
            "count": sum(len(ids) for _, ids in dup_groups),
            "groups": len(dup_groups),
            "examples": [{"text": samples[d][:80], "ids": ids[:MAX_LISTED]} for d, ids in dup_groups[:5]],
        },
        "length_chars": dist,
        "length_tokens": percentiles(tokens),
        "outliers": {"count": len(outliers), "ids": outliers[:MAX_LISTED], "low": low, "high": high,
                     "rule": f"outside [p50/{OUTLIER_FACTOR:g}, p50*{OUTLIER_FACTOR:g}] chars"},
        "lengths": lengths,
    }
    report["headline"] = headline(report)
    return report


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def format_table(report: dict) -> str:
    """The report as a plain two-column table for the terminal."""
    n = max(report["records"], 1)
    m = max(report["outputs"], 1)
    lc, lt = report["length_chars"], report["length_tokens"]
    rows = [("records", f"{report['records']}")]
    if "input" in report:
        rows += [("input items", str(report["input_items"])), ("  missing (no record)", str(report["missing"]["count"])),
                 ("  extra (not in input)", str(report["extra"]["count"]))]
    rows += [
        ("succeeded", f"{report['succeeded']} ({100 * report['succeeded'] / n:.1f}%)"),
        ("failed", f"{report['failed']} ({100 * report['failed'] / n:.1f}%)"),
    ]
    rows += [(f"  error: {kind}", str(count)) for kind, count in report["errors"].items()]
    rows += [
        ("outputs", str(report["outputs"])),
        ("empty outputs", f"{report['empty_outputs']['count']} ({100 * report['empty_outputs']['count'] / m:.1f}%)"),
        (f"too short (< {SHORT_CHARS} chars)", str(report["too_short_outputs"]["count"])),
        ("exact-duplicate outputs", f"{report['duplicate_outputs']['count']} in {report['duplicate_outputs']['groups']}"
                                    " group(s)"),
        ("length chars p5/p50/p95", f"{_fmt(lc['p5'])} / {_fmt(lc['p50'])} / {_fmt(lc['p95'])}"),
        ("length tokens p5/p50/p95", f"{_fmt(lt['p5'])} / {_fmt(lt['p50'])} / {_fmt(lt['p95'])}"),
        ("length outliers", f"{report['outliers']['count']} ({report['outliers']['rule']})"),
    ]
    rows += [(f"  finish: {reason}", str(count)) for reason, count in report["finish_reasons"].items()]
    if report["duplicate_records"]:
        rows.append(("superseded records", str(report["duplicate_records"])))
    if report["unreadable_lines"]:
        rows.append(("unreadable lines", str(report["unreadable_lines"])))
    width = max(len(k) for k, _ in rows)
    lines = [f"batch report: {report['file']}: {report['headline']}", "-" * (width + 24)]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def plot_lengths(report: dict, path: str | Path) -> None:
    """A PNG histogram of output lengths (chars), with p5/p50/p95 and the outlier bounds marked.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'celeris[report]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = report["lengths"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if lengths:
        ax.hist(lengths, bins=min(50, max(5, len(set(lengths)))), color="#4c78a8", edgecolor="white")
    dist, out = report["length_chars"], report["outliers"]
    for name, style in (("p5", ":"), ("p50", "-"), ("p95", ":")):
        if dist[name] is not None:
            ax.axvline(dist[name], color="black", linestyle=style, linewidth=1, label=f"{name} = {dist[name]:g}")
    for bound in (out["low"], out["high"]):
        if bound is not None and lengths and min(lengths) <= bound <= max(lengths):
            ax.axvline(bound, color="#e45756", linestyle="--", linewidth=1)
    ax.set_xlabel("output length (characters)")
    ax.set_ylabel("outputs")
    ax.set_title(f"{Path(report['file']).name}: {len(lengths)} non-empty outputs, "
                 f"{report['empty_outputs']['count']} empty, {out['count']} outliers, {report['failed']} failed")
    if lengths:
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_json(report: dict, path: str | Path) -> None:
    """Write the report (without the raw length list) atomically."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({k: v for k, v in report.items() if k != "lengths"}, indent=1) + "\n")
    tmp.replace(path)
