"""The ``envloop`` command line: parsing, ``envs``, ``check-env``, config errors, wiring.

The full ``run`` / ``report`` / ``reverify`` cycle on tiny models is in
tests/integration/test_cli_run.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from envloop.cli.envs import ENVS_HEADER
from envloop.cli.main import _optional_import, main
from tests.conftest import REPO_ROOT


def test_help_and_usage_errors(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "check-env" in out and "``" not in out
    assert out.split("\n\n")[1] == "The envloop command."
    assert " ".join(out.split()).endswith(
        "2 for a bad command line or config, 130 / 143 for a run stopped by Ctrl-C / SIGTERM "
        "(it prints the command that resumes it)."
    )
    assert main([]) == 2
    assert main(["fly"]) == 2
    assert "invalid choice: 'fly'" in capsys.readouterr().err


def test_envs_lists_config_fields_and_defaults(capsys):
    assert main(["envs"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(ENVS_HEADER + "\n\n")
    assert "math  (envloop.environments.math_environment:MathEnvironment)" in out
    assert "sliding_puzzle  (envloop.environments.games.sliding_puzzle:SlidingPuzzleEnv)" in out
    header, *math = out.split("math  (")[1].split("\n\n")[0].splitlines()[1:]
    assert header.split() == ["key", "type", "default", "description"]
    assert [line.split()[:3] for line in math] == [
        ["num_workers", "int", "2"],
        ["verify_timeout_s", "float", "10.0"],
        ["stop_strings", "list", "of"],
        ["reward_mode", "one", "of"],
        ["max_attempts", "int", "1"],
        ["observation_role", "str", '"environment"'],
        ["verifier_type", "one", "of"],
        ["math_verify_impl", "one", "of"],
        ["max_parse_chars", "int", "1000000"],
    ]
    assert re.search(r'"correctness" +one reward, or correctness \+ format', math[3])
    # the default is shown once, in its column; null (not None) throughout
    assert math[0].endswith(
        "  2                 worker processes checking answers with math-verify"
    )
    assert math[2].endswith("  null              stop strings for a next turn (null: EOS only)")
    assert "None" not in out and "(default " not in out
    assert main(["envs", "mth"]) == 1
    assert "Did you mean 'math'?" in capsys.readouterr().out


def test_a_closed_pipe_ends_quietly():
    """``envloop envs | head -1``: the reader is gone before the output is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    code = "import sys; from envloop.cli.main import main; sys.exit(main(['envs']))"
    child = subprocess.run(
        [sys.executable, "-c", code], stdout=write_end, stderr=subprocess.PIPE, text=True
    )
    os.close(write_end)
    assert (child.returncode, child.stderr) == (0, "")


def test_check_env_passes_a_good_environment(capsys):
    assert main(["check-env", "math", "--config", "{num_workers: 1}"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "OK: MathEnvironment keeps the environment contract on 2 samples",
        "  sample 0: reward 1; environment: 'Environment: correct'",
        "  sample 1: reward 0; environment: 'Environment: incorrect'",
    ]


def test_check_env_with_samples_from_a_file(tmp_path, capsys):
    board = {"board": [[1, 2], [0, 3]], "size": 2, "moves_made": 0, "invalid_moves": 0,
             "max_moves": 5, "seed": 0}  # fmt: skip
    sample = {"messages": [{"role": "user", "content": "Solve."},
                           {"role": "assistant", "content": "<action>left</action>"}],
              "metadata": board}  # fmt: skip
    path = tmp_path / "samples.jsonl"
    path.write_text(json.dumps(sample) + "\n")
    target = "envloop.environments.games.sliding_puzzle:SlidingPuzzleEnv"
    assert main(["check-env", target, "--sample-jsonl", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "OK: SlidingPuzzleEnv keeps the environment contract on 1 sample"
    assert out[1].startswith("  sample 0: reward 1; user: ") and "Solved in 1 move!" in out[1]


def test_check_env_reports_broken_environments(capsys, tmp_path):
    assert main(["check-env", "tests.fixtures.envs:BadContractEnv"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAILED: BadContractEnv breaks the environment contract:")
    assert main(["check-env", "math", "--config", "{num_workers: 0}"]) == 1
    assert "FAILED: MathEnvironment(config) raised ConfigError" in capsys.readouterr().out
    assert main(["check-env", "tests.fixtures.envs:Missing"]) == 1
    assert "module tests.fixtures.envs has no class 'Missing'" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"metadata": {}}\n')
    assert main(["check-env", "math", "--sample-jsonl", str(tmp_path / "bad.jsonl")]) == 1
    assert "bad.jsonl, line 1: expected" in capsys.readouterr().err


def test_run_config_errors_name_dotted_keys(tmp_path, tiny_policy_dir, capsys):
    (tmp_path / "d.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?"}\n')
    config = tmp_path / "run.yaml"
    config.write_text(
        f"policy: {{model_name: {tiny_policy_dir}, tempreature: 2}}\n"
        "data: {path: d.jsonl}\nenvs: {math: {name: math}}\nrollout: {max_turns: four}\n"
    )
    assert main(["run", str(config)]) == 2
    err = capsys.readouterr().err
    assert "policy.tempreature: unknown option. Did you mean 'temperature'?" in err
    assert "rollout.max_turns: expected int, got str ('four')" in err
    fixed = ["policy.tempreature=null", "rollout.max_turns=2"]
    assert main(["run", str(config), *fixed]) == 2
    assert "policy.tempreature: unknown option" in capsys.readouterr().err  # null is a value too
    config.write_text(f"policy: {{model_name: {tiny_policy_dir}}}\ndata: {{path: d.jsonl}}\n"
                      "envs: {math: {name: math}}\n")  # fmt: skip
    assert main(["run", str(config)]) == 2
    assert "data.columns.prompt: no column 'prompt' in the dataset (columns: question, answer)" in (
        capsys.readouterr().err
    )
    columns = ["data.columns.prompt=question", "data.columns.ground_truth=answer"]
    assert main(["run", str(config), *columns]) == 2
    assert "row 1 (line 2 of d.jsonl): no ground truth (column 'answer'" in capsys.readouterr().err


def test_report_and_reverify_say_when_their_modules_are_missing(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "envloop.report.page", None)
    monkeypatch.setitem(sys.modules, "envloop.report.reverify", None)
    assert main(["report", str(tmp_path)]) == 1
    assert "envloop.report.page is not available" in capsys.readouterr().err
    assert main(["reverify", str(tmp_path)]) == 1
    assert "envloop.report.reverify is not available" in capsys.readouterr().err
    assert _optional_import("json", "dumps") is json.dumps
    assert _optional_import("tests.fixtures.no_such_module_here", "x") is None


DEMO = str(REPO_ROOT / "examples" / "demo.yaml")
PROBE = (
    "import sys; from envloop.cli.main import main; status = main(['run', *sys.argv[1:]]); "
    "print(status, *[m for m in ('torch', 'transformers', 'ray') if m in sys.modules])"
)
HUB_RULES = (
    "hub id (org/name or name: letters, digits, '-', '_' and '.', not starting or ending with "
    "'-' or '.', no '--' or '..')"
)
MODEL_FIX = (
    "an existing model folder, a hub id or bundled:<name> "
    "(policy, policy_early, reward_model, vlm_policy, judge)."
)


def run_demo(*overrides, env=None):
    """``envloop run examples/demo.yaml OVERRIDES`` in a fresh interpreter: its exit status
    and the heavy modules it had imported when it returned, and its stderr."""
    child = subprocess.run(
        [sys.executable, "-c", PROBE, DEMO, *overrides],
        capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=600,
    )  # fmt: skip
    return child.stdout.split(), child.stderr


def no_folder(key, value):
    return (
        f"envloop run: invalid run config: {key}: no such folder: {value!r} (read as a local "
        f"path; hub ids look like org/name, e.g. Qwen/Qwen3-0.6B). Set {key} to {MODEL_FIX}\n"
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.max_turns=x", "rollout.max_turns: expected int, got str ('x')\n"),
        ("policy.model_name=/nonexistent", None),
        ("policy.tokenizer_name=./no/such/tokenizer", None),
        ("envs.reward_model.config.model_name=~/nonexistent", None),
        (
            "policy.model_name=bad..name",
            f"policy.model_name: 'bad..name' is neither an existing folder nor a valid "
            f"{HUB_RULES}. Set policy.model_name to {MODEL_FIX}\n",
        ),
        (
            "envs.reward_model.config.checkpoint_path=/nonexistent.safetensors",
            "envs.reward_model.config.checkpoint_path: no such file: '/nonexistent.safetensors'. "
            "Set envs.reward_model.config.checkpoint_path to an existing state-dict file "
            "(.safetensors or a torch checkpoint), or null.\n",
        ),
        (
            "data.path=no_such_prompts.jsonl",
            "data.path: no such file or folder: 'no_such_prompts.jsonl' (relative paths are "
            "looked up in the current directory, then next to the config file). Set data.path "
            "to a .jsonl or .parquet file, a folder saved with save_to_disk, or a hub dataset "
            "id (org/name).\n",
        ),
    ],
)
def test_run_config_errors_are_one_line_before_torch(override, message):
    key, _, value = override.partition("=")
    expected = (
        no_folder(key, value) if message is None else f"envloop run: invalid run config: {message}"
    )
    status_and_modules, err = run_demo(override)
    assert (status_and_modules, err) == (["2"], expected)  # nothing heavy imported


def test_prompts_longer_than_max_seq_len_fail_before_ray(tmp_path):
    # The first run loads the policy's tokenizer through AutoTokenizer (which imports
    # torch) and remembers its class; later runs load that class directly (no torch).
    cache = {"ENVLOOP_CACHE_DIR": str(tmp_path / "cache")}
    for modules in (["torch", "transformers"], ["transformers"]):
        status_and_modules, err = run_demo("rollout.max_seq_len=120", env=cache)
        assert err == (
            "envloop run: invalid run config: rollout.max_seq_len: 120 is smaller than 3 "
            "prompts (row 13: 126 tokens, row 15: 124 tokens, row 17: 126 tokens); set "
            "rollout.max_seq_len to at least 126 "
            "plus room for the responses, or shorten those prompts\n"
        )
        assert status_and_modules == ["2", *modules]  # no ray


def test_a_hub_id_that_cannot_be_loaded_is_one_line_before_ray():
    status_and_modules, err = run_demo(
        "policy.model_name=org/never-cached", env={"HF_HUB_OFFLINE": "1"}
    )
    assert err.startswith(
        "envloop run: error: policy.model_name: Tokenizer 'org/never-cached' could not be loaded "
        "from the hub (or its local cache): "
    )
    assert err.count("\n") == 1 and "Traceback" not in err
    assert status_and_modules == ["1", "torch", "transformers"]  # no ray


def test_run_overrides_may_follow_its_options(capsys):
    assert main(["run", DEMO, "--quiet", "rollout.max_turns=x"]) == 2
    assert capsys.readouterr().err == (
        "envloop run: invalid run config: rollout.max_turns: expected int, got str ('x')\n"
    )
    assert main(["run", DEMO, "--quiet", "--bogus"]) == 2
    assert capsys.readouterr().err.endswith("envloop: error: unrecognized arguments: --bogus\n")
