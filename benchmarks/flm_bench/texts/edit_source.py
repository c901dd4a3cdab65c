"""Small text and scheduling utilities.

The source edited by the code workloads of ``litellm-flm bench --workloads`` (``flm_bench.workloads``):
written for the benchmark, in the manner of the standard library, and never trained on.
"""

import re
from collections import OrderedDict

__all__ = ["parse_duration", "wrap_paragraphs", "read_ini_sections", "group_by_window", "format_table",
           "split_command", "percentiles"]

_UNITS = {"w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1, "ms": 0.001}
_PART = re.compile(r"\s*(\d+(?:\.\d*)?)\s*(ms|w|d|h|m|s)\s*", re.IGNORECASE)


def parse_duration(text, default_unit="s", allow_negative=False):
    """Return the number of seconds in a duration such as ``"1h 30m"`` or ``"2.5d"``.

    A bare number is read in *default_unit*. Each unit may appear once, largest
    first. A leading minus sign is accepted only when *allow_negative* is true.
    Raise ValueError for anything else.
    """
    if not isinstance(text, str):
        raise TypeError("duration must be a string, not %s" % type(text).__name__)
    stripped = text.strip()
    if not stripped:
        raise ValueError("empty duration")
    sign = 1
    if stripped[0] == "-":
        if not allow_negative:
            raise ValueError("negative duration: %r" % text)
        sign = -1
        stripped = stripped[1:].lstrip()
    if default_unit not in _UNITS:
        raise ValueError("unknown default unit: %r" % default_unit)
    try:
        return sign * float(stripped) * _UNITS[default_unit]
    except ValueError:
        pass
    total = 0.0
    seen = []
    pos = 0
    while pos < len(stripped):
        match = _PART.match(stripped, pos)
        if match is None:
            raise ValueError("bad duration %r at position %d" % (text, pos))
        amount, unit = match.groups()
        unit = unit.lower()
        if unit in seen:
            raise ValueError("unit %r given twice in %r" % (unit, text))
        if seen and _UNITS[seen[-1]] <= _UNITS[unit]:
            raise ValueError("units out of order in %r" % text)
        seen.append(unit)
        total += float(amount) * _UNITS[unit]
        pos = match.end()
    if not seen:
        raise ValueError("no duration in %r" % text)
    return sign * total


def wrap_paragraphs(text, width=70, indent="", keep_blank_lines=False):
    """Wrap each paragraph of *text* to lines of at most *width* characters.

    Paragraphs are separated by blank lines. Each output line starts with
    *indent*. Words longer than the room left are put on a line of their own.
    With *keep_blank_lines*, runs of blank lines are kept instead of being
    folded into one.
    """
    room = width - len(indent)
    if room < 1:
        raise ValueError("width %d leaves no room after the indent" % width)
    paragraphs = []
    current = []
    blanks = 0
    for line in text.splitlines():
        if line.strip():
            if blanks and paragraphs and keep_blank_lines:
                paragraphs.extend([None] * (blanks - 1))
            blanks = 0
            current.extend(line.split())
        else:
            if current:
                paragraphs.append(current)
                current = []
            blanks += 1
    if current:
        paragraphs.append(current)
    out = []
    for words in paragraphs:
        if out:
            out.append("")
        if words is None:
            continue
        line = []
        length = 0
        for word in words:
            extra = len(word) + (1 if line else 0)
            if line and length + extra > room:
                out.append(indent + " ".join(line))
                line = []
                length = 0
                extra = len(word)
            line.append(word)
            length += extra
        if line:
            out.append(indent + " ".join(line))
    return "\n".join(out)


def read_ini_sections(lines, comment_prefixes=("#", ";"), lowercase_keys=True):
    """Read INI-style *lines* into an ordered mapping of sections to options.

    Lines before the first ``[section]`` header go to the section ``""``. An
    option is ``key = value`` or ``key: value``; a line that starts with
    whitespace continues the value of the option above it. Comment lines and
    blank lines are skipped. Raise ValueError on a line that is none of these.
    """
    sections = OrderedDict()
    section = ""
    sections[section] = OrderedDict()
    key = None
    for number, raw in enumerate(lines, 1):
        line = raw.rstrip("\r\n")
        stripped = line.strip()
        if not stripped or stripped.startswith(tuple(comment_prefixes)):
            continue
        if line[0] in " \t" and key is not None:
            previous = sections[section][key]
            sections[section][key] = previous + "\n" + stripped if previous else stripped
            continue
        if stripped.startswith("["):
            if not stripped.endswith("]"):
                raise ValueError("line %d: unterminated section header" % number)
            section = stripped[1:-1].strip()
            if not section:
                raise ValueError("line %d: empty section name" % number)
            sections.setdefault(section, OrderedDict())
            key = None
            continue
        cut = min((i for i in (line.find("="), line.find(":")) if i >= 0), default=-1)
        if cut <= 0:
            raise ValueError("line %d: expected 'key = value', got %r" % (number, line))
        key = line[:cut].strip()
        if lowercase_keys:
            key = key.lower()
        value = line[cut + 1:].strip()
        if key in sections[section]:
            raise ValueError("line %d: option %r repeated in section %r" % (number, key, section))
        sections[section][key] = value
    if not sections[""]:
        del sections[""]
    return sections


def group_by_window(events, window, key=None, max_group=None, drop_singletons=False):
    """Group time-ordered *events* into runs no longer than *window* seconds.

    *key* gives an event's time (default: the event itself). A run starts at
    its first event and takes every later event within *window* of it, up to
    *max_group* events. With *drop_singletons*, runs of one event are left
    out. Return a list of lists. Raise ValueError if the events are not in
    time order or if *window* is negative.
    """
    if window < 0:
        raise ValueError("window must not be negative")
    if max_group is not None and max_group < 1:
        raise ValueError("max_group must be at least 1")
    if key is None:
        def key(event):
            return event
    groups = []
    current = []
    start = None
    last = None
    for event in events:
        when = key(event)
        if last is not None and when < last:
            raise ValueError("events out of order: %r after %r" % (when, last))
        last = when
        full = max_group is not None and len(current) >= max_group
        if start is None or when - start > window or full:
            if current:
                groups.append(current)
            current = [event]
            start = when
        else:
            current.append(event)
    if current:
        groups.append(current)
    if drop_singletons:
        kept = []
        for group in groups:
            if len(group) > 1:
                kept.append(group)
        groups = kept
    return groups


def format_table(rows, headers=None, align=None, padding=1, max_width=None):
    """Return *rows* (sequences of cells) as a plain-text table.

    Cells are converted with str(). *headers*, if given, is printed first and
    underlined with dashes. *align* is a string with one of ``"<"``, ``">"`` or
    ``"^"`` per column (default: numbers right, everything else left). Cells
    longer than *max_width* are cut and end with ``"..."``. Raise ValueError if
    the rows do not all have the same number of cells.
    """
    table = [list(row) for row in rows]
    if headers is not None:
        table.insert(0, list(headers))
    if not table:
        return ""
    columns = len(table[0])
    for row in table:
        if len(row) != columns:
            raise ValueError("row %r has %d cells, expected %d" % (row, len(row), columns))
    if align is None:
        body = table[1:] if headers is not None else table
        align = "".join(
            ">" if body and all(isinstance(row[i], (int, float)) for row in body) else "<"
            for i in range(columns)
        )
    elif len(align) != columns or set(align) - set("<>^"):
        raise ValueError("align must have one of '<', '>', '^' per column")
    cells = [[str(cell) for cell in row] for row in table]
    if max_width is not None:
        if max_width < 4:
            raise ValueError("max_width must be at least 4")
        for row in cells:
            for i, cell in enumerate(row):
                if len(cell) > max_width:
                    row[i] = cell[:max_width - 3] + "..."
    widths = [max(len(row[i]) for row in cells) for i in range(columns)]
    gap = " " * padding
    lines = []
    for index, row in enumerate(cells):
        parts = [format(cell, align[i] + str(widths[i])) for i, cell in enumerate(row)]
        lines.append(gap.join(parts).rstrip())
        if index == 0 and headers is not None:
            lines.append(gap.join("-" * w for w in widths))
    return "\n".join(lines)


def split_command(text, comments=False, keep_quotes=False):
    """Split *text* into words the way a simple shell would.

    Words are separated by whitespace. Single quotes keep everything up to the
    next single quote; double quotes keep everything up to the next unescaped
    double quote, where a backslash escapes ``"`` and ``\\``. Outside quotes, a
    backslash escapes the next character. With *comments*, a ``#`` that starts
    a word ends the line. With *keep_quotes*, the quote characters stay in the
    words. Raise ValueError on an unterminated quote or a trailing backslash.
    """
    words = []
    word = []
    in_word = False
    i = 0
    n = len(text)
    while i < n:
        char = text[i]
        if char.isspace():
            if in_word:
                words.append("".join(word))
                word = []
                in_word = False
            i += 1
            continue
        if comments and char == "#" and not in_word:
            break
        in_word = True
        if char == "\\":
            if i + 1 == n:
                raise ValueError("trailing backslash in %r" % text)
            word.append(text[i + 1])
            i += 2
        elif char in "'\"":
            end = i + 1
            quoted = []
            while end < n and text[end] != char:
                if char == '"' and text[end] == "\\" and end + 1 < n and text[end + 1] in '"\\':
                    end += 1
                quoted.append(text[end])
                end += 1
            if end == n:
                raise ValueError("unterminated %s quote in %r" % (char, text))
            if keep_quotes:
                quoted = [char] + quoted + [char]
            word.extend(quoted)
            i = end + 1
        else:
            word.append(char)
            i += 1
    if in_word:
        words.append("".join(word))
    return words


def percentiles(values, points=(50, 90, 99), method="linear", nan_policy="raise"):
    """Return a dict mapping each of *points* (0 to 100) to that percentile of *values*.

    *method* is ``"linear"`` (interpolate between the two nearest ranks),
    ``"lower"`` or ``"higher"`` (the nearest rank below or above), or
    ``"nearest"``. NaN values raise ValueError when *nan_policy* is
    ``"raise"`` and are left out when it is ``"omit"``. Raise ValueError for
    no values, a point outside 0..100 or an unknown method.
    """
    if nan_policy not in ("raise", "omit"):
        raise ValueError("nan_policy must be 'raise' or 'omit', not %r" % nan_policy)
    data = []
    for value in values:
        if value != value:
            if nan_policy == "raise":
                raise ValueError("NaN among the values")
            continue
        data.append(value)
    data.sort()
    if not data:
        raise ValueError("percentiles of no values")
    if method not in ("linear", "lower", "higher", "nearest"):
        raise ValueError("unknown method %r" % method)
    result = {}
    last = len(data) - 1
    for point in points:
        if not 0 <= point <= 100:
            raise ValueError("percentile %r is outside 0..100" % point)
        rank = point / 100 * last
        below = int(rank)
        above = min(below + 1, last)
        fraction = rank - below
        if method == "lower" or below == above:
            value = data[below]
        elif method == "higher":
            value = data[above] if fraction > 0 else data[below]
        elif method == "nearest":
            value = data[above] if fraction >= 0.5 else data[below]
        else:
            value = data[below] + (data[above] - data[below]) * fraction
        result[point] = value
    return result
