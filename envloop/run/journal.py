"""The journal of a run: every finished sample, durable as it finishes, and what a resumed
run needs to go on.

``RUN_DIR/journal/`` holds:

- ``run.json``: the resolved config the samples were rolled out with, a fingerprint of the
  prompts (:func:`envloop.run.resume.input_fingerprint`), the number of samples and the
  attempt (1 for the first run, +1 per ``--resume``); written whole (a new file renamed
  over the old one).
- ``records.jsonl``: one line per finished sample, its whole record
  (:func:`envloop.run.records.sample_records`, token columns included, packed: see
  :data:`_PACKED`) with each image given by its file name in ``images/`` instead of its
  PNG bytes.
- ``finished.txt``: the ledger: one finished sample id per line.
- ``batches.jsonl``: the rollout metrics of each rollout call that ran to its end (``size``
  samples, ``metrics``).
- ``lock``: locked (``flock``) by the process writing the journal, which it names; a run
  started, or resumed, on a directory another run is still writing refuses to.

Once the run has written its rollout files and ``metrics.json`` from the journal, the
journal is removed: a finished run directory holds what it held before journals existed.

A sample is recorded in this order, each file flushed and fsynced before the next step:
its images not written yet, its record line, its id in the ledger (samples recorded
together share each fsync: a sync batch, or what an async rollout handed to the
:class:`JournalWriter` thread while it wrote). A sample counts as
finished only once its id is in the ledger, so a process killed at any point loses only
samples whose id is not there (the samples in flight), and leaves at most a partial line
at the end of a file, which :meth:`RunJournal.resume` drops (it keeps, of each id in the
ledger, the first complete record line, and rewrites the files with just those).
"""

from __future__ import annotations

import array
import base64
import fcntl
import json
import os
import queue
import shutil
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from envloop.run.files import IMAGES_DIR, METRICS_FILE, ROLLOUTS_FILE
from envloop.run.records import image_file_name, jsonable

JOURNAL_DIR = "journal"
RUN_FILE = "run.json"
RECORDS_FILE = "records.jsonl"
LEDGER_FILE = "finished.txt"
BATCHES_FILE = "batches.jsonl"
LOCK_FILE = "lock"
FORMAT = 1


class RunJournal:
    """The journal of one run directory (see the module docstring). Open it with
    :meth:`start` (a new run) or :meth:`resume`; :meth:`add` each finished sample's record,
    :meth:`add_batch` each finished rollout call's metrics; :meth:`records` reads the
    records back in sample order."""

    def __init__(self, run_dir: Path, header: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.dir = run_dir / JOURNAL_DIR
        self.header = header
        self.offsets: dict[int, int] = {}  # sample id -> offset of its line in records.jsonl
        self.batches: list[tuple[dict[str, Any], int]] = []  # (metrics, samples) per call
        self.images: set[str] = set()  # image files written and fsynced
        self.write_lock = threading.Lock()  # held while a write is under way
        self._records: IO[bytes] | None = None
        self._ledger: IO[bytes] | None = None
        self._batches: IO[bytes] | None = None
        self._lock: IO[str] | None = None

    @property
    def total(self) -> int:
        """Samples of the whole run."""
        return int(self.header["samples"])

    @property
    def finished(self) -> int:
        """Samples recorded so far."""
        return len(self.offsets)

    @property
    def config(self) -> dict[str, Any]:
        """The resolved config the recorded samples were rolled out with."""
        return dict(self.header["config"])

    @classmethod
    def start(
        cls, run_dir: str | Path, config: Mapping[str, Any], fingerprint: str, total: int
    ) -> RunJournal:
        """A new journal in ``run_dir``; an earlier run's journal, rollout files, metrics,
        report and content-named images there are removed first."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in (ROLLOUTS_FILE, "rollouts.parquet", METRICS_FILE, "report.html"):
            (run_dir / name).unlink(missing_ok=True)
        for path in (run_dir / IMAGES_DIR).glob("*.png"):  # an earlier run's images
            if _is_image_name(path.name):
                path.unlink()
        if (run_dir / JOURNAL_DIR / LOCK_FILE).is_file():
            _take_lock(run_dir / JOURNAL_DIR).close()  # no other run is writing it
        shutil.rmtree(run_dir / JOURNAL_DIR, ignore_errors=True)
        (run_dir / JOURNAL_DIR).mkdir()
        header = {"format": FORMAT, "samples": total, "inputs": fingerprint, "attempt": 1,
                  "config": dict(config)}  # fmt: skip
        journal = cls(run_dir, header)
        journal._lock = _take_lock(journal.dir)
        journal._write_header()
        journal._open()
        return journal

    @classmethod
    def read(cls, run_dir: str | Path) -> RunJournal:
        """The journal of ``run_dir`` as it is on disk (nothing rewritten or opened for
        writing): its header, finished samples and finished rollout calls. FileNotFoundError
        naming the directory when it has none."""
        journal = cls(Path(run_dir), read_header(run_dir))
        journal._load()
        return journal

    @classmethod
    def resume(cls, run_dir: str | Path, config: Mapping[str, Any] | None = None) -> RunJournal:
        """The journal of ``run_dir`` (:meth:`read`), its files rewritten with only the
        finished samples' complete lines and opened to append; its attempt counts one more
        and ``config`` (when given) replaces the recorded one (the caller checked that the
        change changes no result: :func:`envloop.run.resume.check_resumable`)."""
        read_header(run_dir)  # a journal is there (else an error naming the directory)
        lock = _take_lock(Path(run_dir) / JOURNAL_DIR)
        journal = cls.read(run_dir)
        journal._lock = lock
        journal.header["attempt"] = int(journal.header.get("attempt", 1)) + 1
        if config is not None:
            journal.header["config"] = dict(config)
        journal._compact()
        journal._write_header()
        journal._open()
        return journal

    def add(self, *records: Mapping[str, Any]) -> None:
        """Record finished samples (durable when this returns): their new images, then
        their record lines (one fsync), then their ids in the ledger (one fsync)."""
        with self.write_lock:
            self._add(records)

    def _add(self, records: tuple[Mapping[str, Any], ...]) -> None:
        assert self._records is not None and self._ledger is not None, "journal not open"
        lines, samples = bytearray(), []
        offset = self._records.seek(0, os.SEEK_END)
        offsets = {}
        for record in records:
            sample = int(record["sample"])
            if sample in self.offsets or sample in offsets:
                continue  # never rolled out twice, and never stored twice
            names = [self._store_image(png) for png in record.get("images") or ()]
            line = _packed(record)
            if names:
                line["images"] = names
            offsets[sample] = offset + len(lines)
            lines += json.dumps(line, ensure_ascii=False).encode() + b"\n"
            samples.append(sample)
        if not samples:
            return
        _append(self._records, bytes(lines))
        _append(self._ledger, "".join(f"{s}\n" for s in samples).encode())
        self.offsets.update(offsets)

    def add_batch(self, metrics: Mapping[str, Any], size: int) -> None:
        """Record the rollout metrics of a rollout call of ``size`` samples that ended."""
        assert self._batches is not None, "journal not open"
        line = {"size": size, "metrics": jsonable(dict(metrics))}
        with self.write_lock:
            _append(self._batches, json.dumps(line).encode() + b"\n")
        self.batches.append((line["metrics"], size))

    def is_finished(self, sample: int) -> bool:
        return sample in self.offsets

    def records(self, *, images: bool = True) -> Iterator[dict[str, Any]]:
        """The finished samples' records in sample order, each image as its PNG bytes (as
        its file name without ``images``)."""
        with (self.dir / RECORDS_FILE).open("rb") as file:
            for sample in sorted(self.offsets):
                file.seek(self.offsets[sample])
                record = _unpacked(json.loads(file.readline()))
                if images and record.get("images"):
                    record["images"] = [(self.run_dir / n).read_bytes() for n in record["images"]]
                yield record

    def remove(self) -> None:
        """Delete the journal (once the run's rollout files and metrics are written)."""
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def close(self) -> None:
        """Close the files and release the journal's lock."""
        for file in (self._records, self._ledger, self._batches, self._lock):
            if file is not None:
                file.close()
        self._records = self._ledger = self._batches = self._lock = None

    def _store_image(self, png: bytes) -> str:
        name = image_file_name(png)
        if name not in self.images:
            path = self.run_dir / name
            path.parent.mkdir(exist_ok=True)
            with path.open("wb") as file:
                _append(file, png)
            self.images.add(name)
        return name

    def _write_header(self) -> None:
        path = self.dir / RUN_FILE
        _write_whole(path, (json.dumps(self.header, indent=1) + "\n").encode())

    def _open(self) -> None:
        self._records = (self.dir / RECORDS_FILE).open("ab")
        self._ledger = (self.dir / LEDGER_FILE).open("ab")
        self._batches = (self.dir / BATCHES_FILE).open("ab")
        _sync_dir(self.dir)

    def _load(self) -> None:
        """Read the finished samples (ledger ids with a complete record line; the first
        such line of each) and the finished rollout calls."""
        total = self.total
        ledger = {
            int(line)
            for line in _complete_lines(self.dir / LEDGER_FILE)
            if line.strip().isdigit() and int(line) < total
        }
        offset = 0
        for raw in _complete_lines(self.dir / RECORDS_FILE):
            record = _json_object(raw)
            sample = record.get("sample") if record is not None else None
            if isinstance(sample, int) and sample in ledger and sample not in self.offsets:
                self.offsets[sample] = offset
                self.images.update(record.get("images") or ())  # type: ignore[union-attr]
            offset += len(raw)
        for raw in _complete_lines(self.dir / BATCHES_FILE):
            line = _json_object(raw)
            if line is not None and isinstance(line.get("metrics"), dict):
                self.batches.append((line["metrics"], int(line.get("size", 0))))

    def _compact(self) -> None:
        """Rewrite the files with only what :meth:`_load` kept (so appends start after a
        complete line)."""
        records, offsets = bytearray(), {}
        with (self.dir / RECORDS_FILE).open("rb") as file:
            for sample, offset in self.offsets.items():
                file.seek(offset)
                offsets[sample] = len(records)
                records += file.readline()
        self.offsets = offsets
        _write_whole(self.dir / RECORDS_FILE, bytes(records))
        _write_whole(self.dir / LEDGER_FILE, "".join(f"{s}\n" for s in offsets).encode())
        batches = "".join(json.dumps({"size": n, "metrics": m}) + "\n" for m, n in self.batches)
        _write_whole(self.dir / BATCHES_FILE, batches.encode())


def read_header(run_dir: str | Path) -> dict[str, Any]:
    """``run_dir``'s ``journal/run.json``: the config, prompts' fingerprint, number of
    samples and attempt of the run recorded there. FileNotFoundError naming the directory
    when it has no journal (saying so when it holds a finished run)."""
    run_dir = Path(run_dir)
    path = run_dir / JOURNAL_DIR / RUN_FILE
    if not path.is_file():
        if (run_dir / METRICS_FILE).is_file():
            raise FileNotFoundError(
                f"{run_dir} holds a finished run (its {METRICS_FILE} is written and its "
                f"{JOURNAL_DIR}/ removed): nothing to resume; run without --resume to "
                "roll it out again"
            )
        raise FileNotFoundError(
            f"{run_dir} holds no run to resume ({JOURNAL_DIR}/{RUN_FILE} is missing): "
            "run without --resume to start one there"
        )
    header = json.loads(path.read_text(encoding="utf-8"))
    if header.get("format") != FORMAT:
        raise ValueError(
            f"{path}: journal format {header.get('format')!r}, this envloop reads "
            f"{FORMAT}: run without --resume to start the run over"
        )
    return dict(header)


class JournalWriter:
    """Records samples in a thread of its own, so that the thread handing them over (the
    async rollout's event loop) never waits for a disk: :meth:`put` queues a record;
    the thread records everything queued at once (:meth:`RunJournal.add`: one fsync per
    file for all of them). :meth:`flush` returns once everything put is durable (and
    raises the thread's error, if any). A record put but not yet written is lost with
    the process, as the samples in flight are."""

    def __init__(self, journal: RunJournal) -> None:
        self.journal = journal
        self._queue: queue.SimpleQueue[Mapping[str, Any] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="envloop-journal", daemon=True)
        self._thread.start()

    def put(self, record: Mapping[str, Any]) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(record)

    def flush(self) -> None:
        """Wait until every record put is recorded, and stop the thread."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get())
            records = [item for item in items if item is not None]
            try:
                if records and self._error is None:
                    self.journal.add(*records)
            except BaseException as exc:  # raised in the rollout's thread by put / flush
                self._error = exc
            if None in items:
                return


_PACKED = {"input_ids": "q", "generation_logprobs": "f", "generation_policy_versions": "q",
           "loss_mask": "q", "message_token_counts": "q"}  # fmt: skip
"""Token columns stored packed (array typecode: int64, float32): writing a thousand
logprobs as JSON numbers costs milliseconds, packing them microseconds. The logprobs are
float32 values already (the Parquet column's type), so they come back exactly."""


def _packed(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` with its token columns as ``{"array": typecode, "base64": bytes}``."""
    line = dict(record)
    for key, code in _PACKED.items():
        values = line.get(key)
        if isinstance(values, list):
            try:
                packed = array.array(code, values).tobytes()
            except (TypeError, OverflowError):
                continue  # not numbers of that type: stored as JSON
            line[key] = {"array": code, "base64": base64.b64encode(packed).decode()}
    return line


def _unpacked(line: dict[str, Any]) -> dict[str, Any]:
    for key in _PACKED:
        value = line.get(key)
        if isinstance(value, dict) and "array" in value:
            line[key] = array.array(value["array"], base64.b64decode(value["base64"])).tolist()
    return line


def _take_lock(folder: Path) -> IO[str]:
    """``folder/lock``, open and locked (``flock``) by this process, holding its pid; the
    system releases the lock when the process ends, however it ends. RuntimeError naming
    the process when another one holds it (a run still writing the directory)."""
    lock = (folder / LOCK_FILE).open("a+")
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        pid = lock.read().strip() or "unknown"
        lock.close()
        raise RuntimeError(
            f"{folder.parent} is being written by another envloop run (process {pid}): wait "
            "for it to end, or stop it (Ctrl-C or kill), then run again"
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def _append(file: IO[bytes], data: bytes) -> None:
    file.write(data)
    file.flush()
    os.fsync(file.fileno())


def _write_whole(path: Path, data: bytes) -> None:
    """``path`` replaced by ``data`` at once: written to a new file, fsynced, renamed."""
    partial = path.with_name(path.name + ".partial")
    with partial.open("wb") as file:
        _append(file, data)
    os.replace(partial, path)
    _sync_dir(path.parent)


def _sync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _complete_lines(path: Path) -> Iterator[bytes]:
    """The lines of ``path`` that end with a newline (a missing file has none)."""
    if not path.is_file():
        return
    with path.open("rb") as file:
        for line in file:
            if line.endswith(b"\n"):
                yield line


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _is_image_name(name: str) -> bool:
    stem, _, ext = name.partition(".")
    return ext == "png" and len(stem) == 16 and all(c in "0123456789abcdef" for c in stem)
