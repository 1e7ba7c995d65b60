import json
from pathlib import Path


def test_count_file_exists():
    assert Path("/app/count.json").is_file()


def test_count_is_right():
    words = len(Path("/app/corpus.txt").read_text().split())
    assert json.loads(Path("/app/count.json").read_text()) == {"words": words}
