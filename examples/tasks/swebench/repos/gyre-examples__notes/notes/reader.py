from pathlib import Path


def read_note(name):
    path = Path(name)
    return path.read_text().strip() if path.is_file() else ""
