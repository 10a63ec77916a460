"""Render a `stableflash report` page to PNG, to look at it as a reader would.

Uses headless Chromium through playwright when it is installed with its browser
(`pip install playwright && playwright install chromium`); otherwise WeasyPrint and
pypdfium2 (`pip install weasyprint pypdfium2`), which lay the page out as print pages.

    python scripts/screenshot_report.py report.html --out report.png
"""

from __future__ import annotations

import argparse
from pathlib import Path


def with_chromium(page: Path, out: Path) -> bool:
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError:
        return False
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch()
            tab = browser.new_page(viewport={"width": 1200, "height": 900})
            tab.goto(page.resolve().as_uri())
            tab.screenshot(path=str(out), full_page=True)
            browser.close()
        return True
    except Error as error:  # e.g. the browser was never downloaded
        print(f"chromium unavailable ({str(error).splitlines()[0]}); falling back to WeasyPrint")
        return False


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
        with_weasyprint(args.page, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
