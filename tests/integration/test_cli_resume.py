"""``envloop run`` killed with SIGKILL mid-run, then ``--resume``: the rows equal those of an
uninterrupted greedy run, none missing and none twice, text and images, sync and async.

Each run holds chosen samples in its environment while a gate file exists
(:mod:`tests.fixtures.gated_envs`), so the kill lands when exactly the other samples are
recorded; the runs join the suite's Ray session."""

from __future__ import annotations

import signal

import pytest

from envloop.run.files import load_metrics
from envloop.run.journal import JOURNAL_DIR
from envloop.run.outputs import read_rollouts
from tests.fixtures.resumable_runs import (
    ledger,
    run_here,
    start_run,
    text_run_config,
    vision_run_config,
    wait_for_samples,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CASES = {
    # name: (kind, mode, batch size, rows held, sample ids recorded before the kill)
    "text-sync": ("text", "sync", 4, {4, 5}, [0, 1, 2, 3]),
    "text-async": ("text", "async", 12, {3, 8}, sorted(set(range(12)) - {3, 8})),
    "vision-sync": ("vision", "sync", 4, {2}, [0, 1, 2, 3]),
    "vision-async": ("vision", "async", 8, {1}, [0, 1, 4, 5, 6, 7]),
}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from envloop.models.tiny_vlm import save_tiny_vlm

    return save_tiny_vlm(tmp_path_factory.mktemp("vlm"))


@pytest.fixture(scope="module", params=list(CASES))
def killed_and_resumed(request, tmp_path_factory, untied_policy_dir, vlm_dir, ray_session):
    """(case, folder, config, resume output) after: an uninterrupted run into
    ``folder/reference``; the same config in its own process into ``folder/run``, killed
    with SIGKILL once the samples not held are recorded; a refused ``--resume`` with a
    changed ``policy.max_new_tokens``; the ``--resume`` with a harmless change that
    finishes it."""
    kind, mode, batch_size, hold, _ = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    if kind == "text":
        config = text_run_config(folder, untied_policy_dir, mode, batch_size, hold)
    else:
        config = vision_run_config(folder, vlm_dir, mode, batch_size, hold)
    status, out, err = run_here(config, f"output.dir={folder / 'reference'}", "-q")
    assert status == 0, out + err
    (folder / "gate").touch()
    address = ray_session.get_runtime_context().gcs_address
    process = start_run(config, address, "-q")
    try:
        wait_for_samples(folder / "run", len(CASES[request.param][4]), process)
        assert process.poll() is None, process.communicate()
        process.send_signal(signal.SIGKILL)
        process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    killed = sorted(ledger(folder / "run"))
    refused = run_here(config, "policy.max_new_tokens=9", "--resume", "-q")
    after_refusal = sorted(ledger(folder / "run"))
    (folder / "gate").unlink()
    resumed = run_here(config, "rollout.env_startup_timeout_s=300", "--resume", "-q")
    return request.param, folder, killed, refused, after_refusal, resumed


def test_the_kill_keeps_exactly_the_finished_samples(killed_and_resumed):
    case, _, killed, _, _, _ = killed_and_resumed
    assert killed == CASES[case][4]


def test_a_result_changing_edit_refuses_to_resume_and_names_the_key(killed_and_resumed):
    _, _, killed, (status, _, err), after_refusal, _ = killed_and_resumed
    assert status == 2
    assert "policy.max_new_tokens: " in err and " -> 9" in err
    assert "restore the keys above, or run without --resume" in err
    assert after_refusal == killed  # the refused resume changed nothing


def test_the_resumed_run_equals_an_uninterrupted_one_row_for_row(killed_and_resumed):
    case, folder, killed, _, _, (status, out, err) = killed_and_resumed
    assert status == 0, out + err
    assert f"{len(killed)} of " in out and "finished earlier (kept)" in out
    resumed, reference = read_rollouts(folder / "run"), read_rollouts(folder / "reference")
    assert [r["sample"] for r in resumed] == list(range(len(reference)))
    mode = CASES[case][1]
    for got, want in zip(resumed, reference):
        if mode == "async":  # rows generated in other company: equal up to float rounding
            assert got["generation_logprobs"] == pytest.approx(
                want["generation_logprobs"], abs=1e-4
            )
            got = {k: v for k, v in got.items() if k != "generation_logprobs"}
            want = {k: v for k, v in want.items() if k != "generation_logprobs"}
        assert got == want
    if mode == "sync":
        jsonl = (folder / "run" / "rollouts.jsonl").read_text()
        assert jsonl == (folder / "reference" / "rollouts.jsonl").read_text()
    metrics = load_metrics(folder / "run")
    assert metrics["resume"] == {"attempt": 2, "samples_kept": len(killed)}
    assert sum(t["num_samples"] for t in metrics["per_task"].values()) == len(reference)
    assert not (folder / "run" / JOURNAL_DIR).exists()  # a finished run keeps no journal


def test_images_are_stored_once_and_read_back(killed_and_resumed):
    case, folder, *_ = killed_and_resumed
    if CASES[case][0] != "vision":
        pytest.skip("text run")
    resumed = read_rollouts(folder / "run")
    assert all(r["images"] for r in resumed)
    names = sorted(p.name for p in (folder / "run" / "images").iterdir())
    assert names == sorted(p.name for p in (folder / "reference" / "images").iterdir())
