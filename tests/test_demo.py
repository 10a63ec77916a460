from stableflash.demo import train_demo


def test_demo_training_writes_report_with_figures(tmp_path):
    report = train_demo(tmp_path, steps=25)
    html = report.read_text()
    figures = [p for p in tmp_path.glob("*.png")]
    assert len(figures) >= 3
    for figure in figures:
        assert f'src="{figure.name}"' in html and figure.stat().st_size > 10_000
    assert "paper+SFA" in html
