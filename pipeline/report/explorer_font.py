"""The explorer's embedded fonts: the subset of installed fonts that the page's own text needs, as `data:` fonts.

A page must draw its prompt on a machine with no CJK font (a stock Debian with Chromium has none), offline, and
its CSP allows fonts only from `data:`. So the page carries, as WOFF (zlib), the glyphs of exactly the characters
its text uses, from fonts the project installs from PyPI, in this order (a character takes the first font that
has it):
- Noto Sans CJK JP (noto-cjk-sans-jp-regular, SIL OFL 1.1): Chinese (simplified and traditional hanzi), Japanese
  kana and kanji, Korean hangul, Latin, Greek, Cyrillic, CJK punctuation and full-width forms;
- DejaVu Sans (shipped with matplotlib, a project dependency): Arabic, Hebrew, Armenian, Georgian, more
  Latin / Greek / Cyrillic, arrows, maths and other symbols.
Scripts neither covers (e.g. Devanagari, Thai, colour emoji) fall back to the machine's fonts (docs/explorer.md).
Subsetting is deterministic: no timestamp is recalculated, so the same text gives the same bytes.
"""

from __future__ import annotations

import base64
import importlib.util
import io
from pathlib import Path

# (CSS family, package, file inside the package): the order a character tries them in
FONTS = (("nexttoken-cjk", "noto_cjk_sans_jp_regular", "NotoSansCJKjp-Regular.otf"),
         ("nexttoken-dejavu", "matplotlib", "mpl-data/fonts/ttf/DejaVuSans.ttf"))
FAMILIES = ", ".join(f'"{family}"' for family, _, _ in FONTS)


def font_path(package: str, name: str) -> Path | None:
    """The font file inside an installed package, found without importing the package (None: not installed)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / name
    return path if path.is_file() else None


def _subset(path: Path, chars: set[str]) -> tuple[bytes, set[str]]:
    """(WOFF bytes, the characters drawn) of `path` cut down to the glyphs of `chars` it has."""
    from fontTools import subset
    from fontTools.ttLib import TTFont

    # recalcBBoxes=False: the bounding boxes stay the whole font's (a box that holds the subset's glyphs, which is
    # all a browser reads them for); recomputing them draws every kept glyph, half the subsetting time
    font = TTFont(str(path), lazy=True, recalcTimestamp=False, recalcBBoxes=False)
    cmap = font.getBestCmap()
    have = {c for c in chars if ord(c) in cmap}
    options = subset.Options()
    options.flavor = "woff"
    options.layout_features = ["*"]    # ligatures and positioning (Arabic shaping) of the kept glyphs
    options.hinting = False
    options.name_IDs = [0, 1, 2]       # copyright, family, subfamily
    options.notdef_outline = True
    options.drop_tables += ["FFTM"]   # FontForge's timestamps (DejaVu): nothing to draw with
    sub = subset.Subsetter(options)
    sub.populate(text="".join(sorted(have)))
    sub.subset(font)
    out = io.BytesIO()
    font.save(out)
    return out.getvalue(), have


def font_faces(text: str) -> tuple[str, dict[str, int]]:
    """(CSS @font-face rules, characters drawn per family) for the characters of `text` (control characters
    and spaces aside); a family with nothing to draw, or whose package is not installed, is left out."""
    todo = {c for c in text if c.isprintable() and not c.isspace()}
    rules, counts = [], {}
    for family, package, name in FONTS:
        path = font_path(package, name)
        if path is None or not todo:
            continue
        data, drawn = _subset(path, todo)
        if not drawn:
            continue
        todo -= drawn
        counts[family] = len(drawn)
        rules.append(f'@font-face{{font-family:"{family}";font-display:block;'
                     f'src:url(data:font/woff;base64,{base64.b64encode(data).decode("ascii")}) format("woff")}}')
    return "\n".join(rules), counts
