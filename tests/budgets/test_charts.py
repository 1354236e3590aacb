"""Server-side SVG charts: well-formed, escaped, axes from zero."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from budgets.web.charts import (
    Segment,
    Series,
    Threshold,
    capacity_bar,
    human,
    line_chart,
    progress_bar,
    stacked_bar_chart,
)

SVG = "{http://www.w3.org/2000/svg}"


def parse(svg) -> ET.Element:
    return ET.fromstring(str(svg))


def test_line_chart_is_well_formed_and_starts_at_zero():
    svg = parse(line_chart(labels=["a", "b", "c"], series=[Series("used", [0, 5, 10])],
                           thresholds=[Threshold("ceiling", 12)], title="t"))
    assert svg.tag == f"{SVG}svg"
    axis_labels = [t.text for t in svg.iter(f"{SVG}text")]
    assert axis_labels[0] == "0" and "12.5" in axis_labels  # 12 x 1.02 -> a round 12.5 in five ticks of 2.5
    assert len(list(svg.iter(f"{SVG}polyline"))) == 1


def test_text_is_escaped():
    evil = '<script>alert("x")</script>'
    for svg in (
        line_chart(labels=[evil], series=[Series(evil, [1])], title=evil),
        stacked_bar_chart(labels=[evil], stacks=[Series(evil, [1])], title=evil),
        capacity_bar(segments=[Segment(evil, 1)], total=2, title=evil),
        progress_bar(value=1, maximum=2, title=evil),
    ):
        assert "<script>" not in str(svg)
        parse(svg)  # still well-formed XML


def test_stacked_bars_sum_per_label_and_say_none_when_empty():
    svg = str(stacked_bar_chart(labels=["09:00", "09:01"], stacks=[Series("a", [1, 0]), Series("b", [2, 0])], title="t",
                                integer=True))
    assert svg.count("</rect>") == 2  # two bars with values (legend swatches are empty elements)
    assert ">none<" in str(stacked_bar_chart(labels=["09:00"], stacks=[], title="t"))


def test_human_numbers():
    assert [human(v) for v in (0, 7, 1234, 2_500_000, 0.000512, 12.5)] == ["0", "7", "1.2k", "2.5M", "0.000512", "12.5"]
