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


def _view_box(svg: ET.Element) -> tuple[float, float]:
    _x, _y, width, height = (float(v) for v in svg.get("viewBox").split())
    return width, height


def _text_extent(text: ET.Element) -> tuple[float, float]:
    """Where a text runs horizontally, at the charts' own 7 px per character."""
    x, width = float(text.get("x")), 7 * len(text.text or "")
    anchor = text.get("text-anchor", "start")
    start = x - width if anchor == "end" else (x - width / 2 if anchor == "middle" else x)
    return start, start + width


def test_a_long_legend_wraps_inside_the_chart_which_grows_to_hold_it():
    names = [f"workload-with-a-long-name-{i}" for i in range(8)]
    for svg in (
        parse(line_chart(labels=["a", "b"], series=[Series(n, [1, 2]) for n in names], title="t")),
        parse(stacked_bar_chart(labels=["a", "b"], stacks=[Series(n, [1, 2]) for n in names], title="t")),
        parse(capacity_bar(segments=[Segment(n, 10) for n in names], total=100, title="t")),
    ):
        width, height = _view_box(svg)
        legend = [t for t in svg.iter(f"{SVG}text") if (t.text or "").startswith("workload-with")]
        assert [t.text for t in legend] == names
        assert max(float(t.get("y")) for t in legend) <= height - 4  # every line inside, none clipped
        assert len({t.get("y") for t in legend}) > 1  # it did wrap
        assert all(_text_extent(t)[1] <= width for t in legend)


def test_the_last_x_label_is_drawn_and_stays_inside_the_chart():
    labels = [f"11-{d:02d} 23:00" for d in range(1, 31)]
    for svg in (parse(line_chart(labels=labels, series=[Series("used", list(range(30)))], title="t")),
                parse(stacked_bar_chart(labels=labels, stacks=[Series("used", list(range(30)))], title="t"))):
        width, _height = _view_box(svg)
        shown = [t for t in svg.iter(f"{SVG}text") if t.text in labels]
        assert shown[-1].text == labels[-1] and shown[0].text == labels[0]
        for text in shown:
            start, end = _text_extent(text)
            assert 0 <= start and end <= width, (text.text, start, end)
        # no two labels overlap
        extents = sorted(_text_extent(t) for t in shown)
        assert all(a[1] <= b[0] for a, b in zip(extents, extents[1:]))
