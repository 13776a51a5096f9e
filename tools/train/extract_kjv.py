#!/usr/bin/python3
"""Extracts the King James Bible as plain text and splits it into train / held-out parts.

Source: Debian's `bible-kjv-text` package ships the text only in the compressed,
random-access format of the `bible` program (/usr/lib/bible.data + .conc). The `bible`
program (package `bible-kjv`) decompresses it:

    bible -f Gen1:1-Rev22:21

prints every verse on one line as "<book abbreviation><chapter>:<verse> <text>" (-f turns
pretty-printing off). Full book names come from the same program in its default
pretty-printing mode, whose first output line for "<abbr>1:1" is "<Book name> 1".

Output format (train.txt and heldout.txt alike), one chapter after another:

    Genesis 1
    In the beginning God created the heaven and the earth.
    And the earth was without form, and void; ...
    <blank line>
    Genesis 2
    ...

i.e. a "<Book> <chapter>" heading line, then one verse per line (no verse numbers), then a
blank line between chapters; the file ends with a single newline. The text is pure ASCII.

Split: chapters are numbered 0..1188 in canonical order (Genesis 1 = 0, Revelation 22 =
1188); chapter i is held out when i % 20 == 19 (59 chapters, about 5% of the text, spread
over the whole book). Everything else is training text.

Usage:
    /usr/bin/python3 tools/train/extract_kjv.py --out-dir /tmp/kjv
writes /tmp/kjv/train.txt and /tmp/kjv/heldout.txt and prints their sizes.
"""

import argparse
import os
import re
import subprocess

HELDOUT_EVERY = 20
HELDOUT_OFFSET = 19
_VERSE_LINE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")


def _run_bible(args):
    # `bible` reads commands from stdin when it has no more arguments; give it nothing.
    out = subprocess.run(["bible", *args], stdin=subprocess.DEVNULL, capture_output=True,
                         check=True, cwd="/")
    return out.stdout.decode("ascii")


def read_verses():
    """Returns [(abbr, chapter, verse, text)] in canonical order."""
    verses = []
    for line in _run_bible(["-f", "Gen1:1-Rev22:21"]).splitlines():
        if not line.strip():
            continue
        m = _VERSE_LINE.match(line)
        if m is None:
            raise ValueError(f"unexpected line from bible: {line!r}")
        abbr, ch, v, text = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        verses.append((abbr, ch, v, " ".join(text.split())))
    return verses


def book_name(abbr):
    for line in _run_bible([f"{abbr}1:1"]).splitlines():
        if line.strip():
            name, _, ch = line.strip().rpartition(" ")
            if ch != "1" or not name:
                raise ValueError(f"unexpected heading for {abbr}: {line!r}")
            return name
    raise ValueError(f"no heading for {abbr}")


def chapters():
    """Returns [(book_name, chapter, [verse texts])] in canonical order."""
    out, names = [], {}
    for abbr, ch, _, text in read_verses():
        if abbr not in names:
            names[abbr] = book_name(abbr)
        if not out or out[-1][0] != names[abbr] or out[-1][1] != ch:
            out.append((names[abbr], ch, []))
        out[-1][2].append(text)
    return out


def render(chs):
    return "\n".join(f"{name} {ch}\n" + "".join(v + "\n" for v in verses)
                     for name, ch, verses in chs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args()
    chs = chapters()
    assert len(chs) == 1189, len(chs)
    held = [c for i, c in enumerate(chs) if i % HELDOUT_EVERY == HELDOUT_OFFSET]
    train = [c for i, c in enumerate(chs) if i % HELDOUT_EVERY != HELDOUT_OFFSET]
    os.makedirs(args.out_dir, exist_ok=True)
    for fname, part in (("train.txt", train), ("heldout.txt", held)):
        text = render(part)
        with open(os.path.join(args.out_dir, fname), "w", encoding="ascii", newline="\n") as f:
            f.write(text)
        print(f"{fname}: {len(part)} chapters, "
              f"{sum(len(v) for _, _, v in part)} verses, {len(text)} bytes")


if __name__ == "__main__":
    main()
