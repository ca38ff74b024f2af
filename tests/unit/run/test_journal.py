"""The run journal: records durable as they are added, read back in sample order, and a
journal cut anywhere (a partial line, a record without its ledger line) resumed with exactly
the samples whose ids reached the ledger."""

from __future__ import annotations

import array
import json
import os

import pytest
from PIL import Image

from envloop.run.journal import (
    JOURNAL_DIR,
    LEDGER_FILE,
    RECORDS_FILE,
    JournalWriter,
    RunJournal,
)
from envloop.run.records import image_file_name
from envloop.run.records import png_bytes as encoded

CONFIG = {"policy": {"model_name": "m"}, "rollout": {"batch_size": 2}}


def png_bytes(colour):
    return encoded(Image.new("RGB", (2, 2), colour))


def record(sample, *images):
    row = {"sample": sample, "task": "t", "total_reward": sample / 10, "num_turns": 1}
    return {**row, "images": list(images)} if images else row


def test_records_come_back_in_sample_order_with_their_images(tmp_path):
    red, blue = png_bytes((255, 0, 0)), png_bytes((0, 0, 255))
    journal = RunJournal.start(tmp_path, CONFIG, "abc", total=4)
    for sample, images in [(2, [red]), (0, []), (3, [red, blue])]:
        journal.add(record(sample, *images))
    journal.close()
    assert [r["sample"] for r in journal.records()] == [0, 2, 3]
    assert [r.get("images") for r in journal.records()] == [None, [red], [red, blue]]
    line = (tmp_path / JOURNAL_DIR / RECORDS_FILE).read_text().splitlines()[2]
    assert json.loads(line)["images"] == [image_file_name(red), image_file_name(blue)]
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == sorted(
        image_file_name(png)[len("images/") :] for png in (red, blue)
    )


def test_a_resume_keeps_only_samples_whose_id_reached_the_ledger(tmp_path):
    journal = RunJournal.start(tmp_path, CONFIG, "abc", total=6)
    for sample in (0, 1, 2):
        journal.add(record(sample))
    journal.add_batch({"total_generated_tokens": 7}, 3)
    journal.close()
    folder = tmp_path / JOURNAL_DIR
    with (folder / RECORDS_FILE).open("a") as file:  # killed before the ledger line...
        file.write(json.dumps(record(4)) + "\n")
        file.write('{"sample": 5, "task": "t", "tot')  # ... and in the middle of a line
    with (folder / LEDGER_FILE).open("a") as file:
        file.write("5")  # a partial ledger line (no newline) does not count

    resumed = RunJournal.resume(tmp_path, {**CONFIG, "ray": {"num_cpus": 4}})
    assert sorted(resumed.offsets) == [0, 1, 2] and resumed.header["attempt"] == 2
    assert resumed.batches == [({"total_generated_tokens": 7}, 3)]
    resumed.add(record(4))
    resumed.add(record(5))
    resumed.close()
    again = RunJournal.read(tmp_path)
    assert [r["sample"] for r in again.records()] == [0, 1, 2, 4, 5]
    assert (folder / LEDGER_FILE).read_text() == "0\n1\n2\n4\n5\n"
    assert again.config == {**CONFIG, "ray": {"num_cpus": 4}}


def test_a_new_run_clears_the_directory_of_an_earlier_one(tmp_path):
    journal = RunJournal.start(tmp_path, CONFIG, "abc", total=2)
    journal.add(record(0, png_bytes((1, 2, 3))))
    journal.close()
    (tmp_path / "rollouts.jsonl").write_text("{}\n")
    (tmp_path / "images" / "notes.txt").write_text("mine")
    fresh = RunJournal.start(tmp_path, CONFIG, "abc", total=2)
    fresh.close()
    assert fresh.finished == 0 and list(fresh.records()) == []
    assert not (tmp_path / "rollouts.jsonl").exists()
    assert [p.name for p in (tmp_path / "images").iterdir()] == ["notes.txt"]


def test_resuming_without_a_journal_says_why(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no run to resume"):
        RunJournal.read(tmp_path)
    (tmp_path / "metrics.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="holds a finished run .* nothing to resume"):
        RunJournal.read(tmp_path)


def test_the_writer_thread_records_everything_put_before_flush_returns(tmp_path):
    journal = RunJournal.start(tmp_path, CONFIG, "abc", total=50)
    writer = JournalWriter(journal)
    for sample in reversed(range(50)):
        writer.put(record(sample))
    writer.flush()
    assert [r["sample"] for r in journal.records()] == list(range(50))
    assert sorted(map(int, (tmp_path / JOURNAL_DIR / LEDGER_FILE).read_text().split())) == list(
        range(50)
    )


def test_the_writer_thread_s_error_reaches_the_caller(tmp_path):
    journal = RunJournal.start(tmp_path, CONFIG, "abc", total=2)
    writer = JournalWriter(journal)
    writer.put({"task": "t"})  # no sample id
    with pytest.raises(KeyError, match="sample"):
        writer.flush()


def test_token_columns_come_back_exactly(tmp_path):
    logprobs = array.array("f", [-0.1, -2.7182817, 0.0, -1e-8]).tolist()  # float32 values
    tokens = {"input_ids": [5, 151643, 0], "generation_logprobs": logprobs,
              "generation_policy_versions": [0, 3, 3], "loss_mask": [0, 1, 1],
              "message_token_counts": [1, 2]}  # fmt: skip
    journal = RunJournal.start(tmp_path, CONFIG, "abc", total=1)
    journal.add({**record(0), **tokens})
    journal.close()
    [back] = RunJournal.read(tmp_path).records()
    assert back == {**record(0), **tokens}
    assert "151643" not in (tmp_path / JOURNAL_DIR / RECORDS_FILE).read_text()  # packed


def test_a_directory_another_run_is_writing_is_refused(tmp_path):
    writing = RunJournal.start(tmp_path, CONFIG, "abc", total=2)  # holds the lock
    for start_again in (
        lambda: RunJournal.start(tmp_path, CONFIG, "abc", total=2),
        lambda: RunJournal.resume(tmp_path),
    ):
        with pytest.raises(RuntimeError, match=f"another envloop run \\(process {os.getpid()}\\)"):
            start_again()
    writing.add(record(0))
    writing.close()  # the lock goes with it
    resumed = RunJournal.resume(tmp_path)
    assert resumed.finished == 1
    resumed.close()
