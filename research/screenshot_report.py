"""Render a `stableflash report` page to PNG with headless Chromium, to look at it as a reader would.

Needs a Chromium binary (Debian: `apt-get install chromium`); without one it falls back to
WeasyPrint + pypdfium2 (`pip install weasyprint pypdfium2`), which lay the page out as print pages.

    python research/screenshot_report.py report.html --out report.png
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path


def with_chromium(page: Path, out: Path, width: int = 1200, height: int = 8000) -> bool:
    binary = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if binary is None:
        return False
    subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={width},{height}", f"--screenshot={out.resolve()}", page.resolve().as_uri()],
                   check=True, capture_output=True, timeout=120)
    _crop_blank_bottom(out)
    return True


def _crop_blank_bottom(path: Path) -> None:
    """The window is taller than most pages: cut the white below the content."""
    import numpy as np
    from PIL import Image

    image = Image.open(path)
    rows = np.where(np.asarray(image.convert("L")).min(axis=1) < 250)[0]
    if rows.size:
        image.crop((0, 0, image.width, int(rows.max()) + 10)).save(path)


def with_weasyprint(page: Path, out: Path) -> None:
    import pypdfium2
    import weasyprint
    from PIL import Image

    pdf_path = out.with_suffix(".pdf")
    weasyprint.HTML(str(page)).write_pdf(str(pdf_path))
    pages = [p.render(scale=1.0).to_pil() for p in pypdfium2.PdfDocument(str(pdf_path))]
    sheet = Image.new("RGB", (sum(p.width for p in pages), max(p.height for p in pages)), "white")
    x = 0
    for p in pages:
        sheet.paste(p, (x, 0))
        x += p.width
    sheet.save(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", type=Path)
    parser.add_argument("--out", type=Path, default=Path("report.png"))
    args = parser.parse_args()
    if not with_chromium(args.page, args.out):
        print("no Chromium found; rendering with WeasyPrint")
        with_weasyprint(args.page, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
