"""Checks every per-record share flag of the corpus gets (``--open-words``, ``--casual``,
``--tool-errors``, ``--folder-words``): make_corpus writes that share and names it in the
manifest, refuses a share outside [0, 1], and the trainer takes the flag and lays the records
out differently with it."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def written_with_share(tmp_path: Path, flag: str, share: float, kinds: str, refused: float = 2.0) -> list[dict]:
    """The records ``make_corpus.py --n 12 --seed 4 --kinds KINDS FLAG SHARE`` writes, its
    manifest checked to name the share and the flag checked to refuse the share ``refused``."""
    import make_corpus

    make_corpus.main(["--out", str(tmp_path), "--n", "12", "--seed", "4", "--kinds", kinds, flag, str(share)])
    records = [json.loads(line) for line in (tmp_path / "corpus-00000.jsonl").read_text().splitlines()]
    assert json.loads((tmp_path / "manifest.json").read_text())[flag[2:].replace("-", "_")] == share
    with pytest.raises(SystemExit):
        make_corpus.parse_args(["--out", "x", "--n", "1", flag, str(refused)])
    return records


def trainer_takes_share(flag: str, share: float) -> None:
    """``train_default.py FLAG SHARE`` parses, and its tool records (kind b) at a share of 1 are
    laid out unlike those without it."""
    import train_default
    from model.args import ModelArgs

    name = flag[2:].replace("-", "_")
    assert getattr(train_default.parse_args(["--out", "x", flag, str(share)]), name) == share
    args = ModelArgs.preset("tiny")
    on = train_default.make_examples(6, 4, args, workers=1, kinds="b", schedule="b", shares={name: 1.0})
    off = train_default.make_examples(6, 4, args, workers=1, kinds="b", schedule="b")
    assert [list(e.ids) for e in on["short"]] != [list(e.ids) for e in off["short"]]


def share_marks_its_records(tmp_path: Path, flag: str, kinds: str, marked, drawn, refused: float = 2.0) -> None:
    """``make_corpus.py ... --kinds KINDS FLAG 0.5`` marks its records (``marked(record)``) as
    ``drawn(i)`` says record i is, and not all alike; the trainer takes the flag."""
    records = written_with_share(tmp_path, flag, 0.5, kinds, refused)
    marks = [marked(r) for r in records]
    assert marks == [drawn(i) for i in range(len(records))] and len(set(marks)) > 1
    trainer_takes_share(flag, 0.2)
