"""The privacy ledger: every DP step is on disk before it releases, and a run resumed from a checkpoint accounts the
steps that ran after that checkpoint too (a crash can no longer make the reported epsilon smaller than what was
spent)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from opacus.accountants import RDPAccountant

from lightning_longshield import LongShieldStrategy
from lightning_longshield.checkpoints import CHECKPOINT_KEY
from lightning_longshield.durable_checkpoints import is_whole_checkpoint
from lightning_longshield.privacy.cut_off import KEYSTREAM_TAIL
from lightning_longshield.privacy.ledger import (
    LEDGER_FILE,
    PrivacyLedger,
    missing_indices,
    read_ledger,
    steps_after,
)
from lightning_longshield.privacy.plan import PrivacyArguments, PrivacyPlan
from lightning_longshield.privacy.session import PrivacySession
from lightning_longshield.sharded_checkpoints import is_whole_sharded_checkpoint
from tests.support.helpers import RandomTokens, loader, make_module, make_trainer, small_config
from tests.support.process_runner import forkserver_context

DATA = RandomTokens(size=32, seq_len=8)  # batch 4: q = 1/8
DELTA = 1e-3


def test_lines_are_whole_and_per_run(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = PrivacyLedger(path, "run-a")
    assert path.exists() and path.read_text() == ""  # created at once: a missing ledger means a lost one
    ledger.record(0, 1.0, 0.125)
    ledger.record(1, 1.0, 0.125)
    ledger.close()
    PrivacyLedger(path, "run-b").record(0, 2.0, 0.5)
    with open(path, "a") as file:
        file.write('{"run": "run-a", "index": 2, "noise_mul')  # a write torn by a crash: that step never released
    ledger = PrivacyLedger(path, "run-a")
    ledger.record(2, 1.0, 0.125)  # the step ran again after the resume
    ledger.close()
    entries = read_ledger(path, "run-a").entries
    assert [(e.index, e.noise_multiplier, e.sample_rate) for e in entries] == [(0, 1.0, 0.125), (1, 1.0, 0.125),
                                                                              (2, 1.0, 0.125)]
    assert [e.index for e in read_ledger(path, "run-b").entries] == [0]
    assert [e.index for e in steps_after(entries, 1)] == [1, 2]
    whole = [line for line in path.read_text().splitlines() if line.endswith("}")]
    assert len(whole) == 4  # the torn line stayed alone on its line
    for line in whole:
        assert set(json.loads(line)) == {"run", "index", "noise_multiplier", "sample_rate", "poisson", "reproducible"}


def test_a_fragment_glued_to_another_runs_line_is_skipped_and_damaged_lines_are_counted(tmp_path):
    """Run A dies inside a write while run B, sharing the file, has it open: B's next line is appended to A's
    fragment, and still reads as B's step. A line damaged in place is neither skipped nor read: it is counted."""
    path = tmp_path / "ledger.jsonl"
    ledger_b = PrivacyLedger(path, "run-b")
    ledger_b.record(0, 1.0, 0.125)
    with open(path, "a") as file:
        file.write('{"run": "run-a", "index": 7, "noise_mul')
    ledger_b.record(1, 1.0, 0.125)
    ledger_b.record(2, 1.0, 0.125)
    ledger_b.close()
    assert [e.index for e in read_ledger(path, "run-b").entries] == [0, 1, 2]
    assert read_ledger(path, "run-b").damaged == 0 and read_ledger(path, "run-a").entries == []
    lines = path.read_text().splitlines()
    lines[2] = lines[2].replace('"index": 2', '"index": 2x')
    path.write_text("\n".join(lines) + "\n")
    reading = read_ledger(path, "run-b")
    assert [e.index for e in reading.entries] == [0, 1] and reading.damaged == 1
    assert missing_indices(reading.entries, 0) == 0  # the last line: no gap shows it, the damage count does
    assert missing_indices([e for e in reading.entries if e.index != 0], 0) == 1  # step 0 lost


def _strategy(**kwargs) -> LongShieldStrategy:
    return LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=DELTA, **kwargs)


def _fit(strategy: LongShieldStrategy, root, max_steps: int, ckpt_path=None) -> None:
    checkpoints = ModelCheckpoint(dirpath=root / "checkpoints", filename="{step}", every_n_train_steps=2,
                                  save_top_k=-1)
    trainer = make_trainer(strategy, max_steps=max_steps, default_root_dir=root, enable_checkpointing=True,
                           callbacks=[checkpoints])
    trainer.fit(make_module(small_config(n_layers=1), optimizer="adamw", learning_rate=1e-2), loader(DATA, 4),
                ckpt_path=ckpt_path)


def _rdp_epsilon(steps: int) -> float:
    accountant = RDPAccountant()
    accountant.history = [(1.0, 0.125, steps)]
    return accountant.get_epsilon(DELTA)


def test_a_resume_accounts_the_steps_that_ran_after_its_checkpoint(tmp_path):
    """Checkpoints at steps 2 and 4, the step-4 file lost, resume from step 2 to step 4: six steps ran."""
    _fit(_strategy(), tmp_path, max_steps=4)
    assert len(read_ledger(tmp_path / LEDGER_FILE, _run_id(tmp_path)).entries) == 4
    (tmp_path / "checkpoints" / "step=4.ckpt").unlink()
    resumed = _strategy()
    _fit(resumed, tmp_path, max_steps=4, ckpt_path=tmp_path / "checkpoints" / "step=2.ckpt")
    assert resumed.accountant.steps == 6 and resumed.privacy.rolled_back_steps == 2
    assert resumed.get_epsilon() == pytest.approx(_rdp_epsilon(6), rel=1e-9)
    assert resumed.get_epsilon() > _rdp_epsilon(4)  # what the checkpoint alone would report
    assert "after 6 steps run, of which 2 were rolled back by a resume" in resumed.privacy.describe_guarantee()
    assert len(read_ledger(tmp_path / LEDGER_FILE, _run_id(tmp_path)).entries) == 6  # resumed steps recorded too


def test_a_missing_ledger_is_warned_about(tmp_path):
    _fit(_strategy(), tmp_path, max_steps=2)
    (tmp_path / LEDGER_FILE).unlink()
    resumed = _strategy()
    with pytest.warns(UserWarning, match="privacy ledger .* is missing: epsilon counts the checkpoint's 2 steps"):
        _fit(resumed, tmp_path, max_steps=3, ckpt_path=tmp_path / "checkpoints" / "step=2.ckpt")
    assert resumed.accountant.steps == 3


def test_a_damaged_line_of_a_step_after_the_checkpoint_is_counted(tmp_path):
    """Six steps ran (checkpoints at 2, 4, 6; the last two lost) and the line of step 3 is damaged: the resume from
    step 2 counts it, as a step of the run, with a warning, and reports no fewer than the six steps that ran."""
    _fit(_strategy(), tmp_path, max_steps=6)
    for step in (4, 6):
        (tmp_path / "checkpoints" / f"step={step}.ckpt").unlink()
    lines = [line.replace('"index": 3,', '"index": 3x,') for line in (tmp_path / LEDGER_FILE).read_text().splitlines()]
    (tmp_path / LEDGER_FILE).write_text("\n".join(lines) + "\n")
    resumed = _strategy()
    with pytest.warns(UserWarning, match="has 2 damaged lines or gaps among this run's steps after the checkpoint"):
        _fit(resumed, tmp_path, max_steps=2, ckpt_path=tmp_path / "checkpoints" / "step=2.ckpt")
    assert resumed.accountant.steps == 7  # the damaged line and the gap it leaves, each counted: never fewer than 6
    # A resume from the resumed run's own checkpoint counts neither again, nor calls the ledger truncated for the
    # indices their stand-ins took
    _fit(_strategy(), tmp_path, max_steps=10, ckpt_path=tmp_path / "checkpoints" / "step=2.ckpt")
    again = _strategy()
    _fit(again, tmp_path, max_steps=10, ckpt_path=tmp_path / "checkpoints" / "step=10.ckpt")
    assert again.accountant.steps == 7 + 8 + 0 and not again.privacy.accounting_incomplete


def test_a_missing_ledger_makes_every_later_guarantee_a_lower_bound(tmp_path):
    """Steps that ran after the checkpoint are unknown once the ledger is gone: the printed guarantee says so, also
    after a further resume from a checkpoint of the resumed run."""
    _fit(_strategy(), tmp_path, max_steps=2)
    (tmp_path / LEDGER_FILE).unlink()
    resumed = _strategy()
    with pytest.warns(UserWarning, match="is missing"):
        _fit(resumed, tmp_path, max_steps=4, ckpt_path=tmp_path / "checkpoints" / "step=2.ckpt")
    assert "(a lower bound: at a resume this run's privacy ledger was missing" in resumed.privacy.describe_guarantee()
    again = _strategy()
    _fit(again, tmp_path, max_steps=5, ckpt_path=tmp_path / "checkpoints" / "step=4.ckpt")
    assert again.accountant.steps == 5 and "(a lower bound:" in again.privacy.describe_guarantee()
    assert "a lower bound" not in _finished_guarantee(tmp_path / "fresh")


def _finished_guarantee(root) -> str:
    strategy = _strategy()
    _fit(strategy, root, max_steps=2)
    return strategy.privacy.describe_guarantee()


@pytest.mark.filterwarnings("ignore:noise_seed is set", "ignore:poisson_sampling=False")
def test_how_steps_before_a_resume_ran_stays_in_the_printed_guarantee(tmp_path):
    """Fixed batches or a noise_seed before a resume are said after it: the checkpoint and the ledger keep them."""
    _fit(_strategy(poisson_sampling=False), tmp_path / "fixed", max_steps=2)
    resumed = _strategy()
    _fit(resumed, tmp_path / "fixed", max_steps=3, ckpt_path=tmp_path / "fixed" / "checkpoints" / "step=2.ckpt")
    assert resumed.privacy.describe_guarantee().startswith(
        "Privacy figure, NOT a guarantee of this run (poisson_sampling=False before a resume")
    _fit(_strategy(noise_seed=3), tmp_path / "seeded", max_steps=2)
    resumed = _strategy()
    _fit(resumed, tmp_path / "seeded", max_steps=3, ckpt_path=tmp_path / "seeded" / "checkpoints" / "step=2.ckpt")
    assert "before a resume: noise and sampling reproducible from a noise_seed" in resumed.privacy.describe_guarantee()
    lines = [json.loads(line) for line in (tmp_path / "seeded" / LEDGER_FILE).read_text().splitlines()]
    lines = [line for line in lines if "index" in line]  # the steps, not the line that opened the ledger
    assert [(line["reproducible"], line["poisson"]) for line in lines] == [(True, True)] * 2 + [(False, True)]
    fresh = _strategy()
    _fit(fresh, tmp_path / "fresh", max_steps=1)
    assert "before a resume" not in fresh.privacy.describe_guarantee()


def _run_id(root) -> str:
    return json.loads((root / LEDGER_FILE).read_text().splitlines()[0])["run"]


@pytest.mark.slow
def test_epsilon_after_sigkills_covers_every_step_that_ran(tmp_path):
    """Seeded SIGKILLs before a step, between its ledger line and its release, after it (before its checkpoint),
    before a checkpoint save and halfway through one; each attempt resumes from the newest checkpoint that loads. No
    checkpoint name ever holds a partial file, and the finished run's epsilon is at least that of every step the
    ledger holds, counted independently here."""
    rng = random.Random(0)
    # The first kill comes after the first checkpoint (step 2): before it, a restart is a new run.
    points = [(rng.randint(2, 3), "release")] + [(rng.randint(0, 1), p)
                                                 for p in ("batch_end", "save", "mid_save", "batch_start")]
    for kill_after, point in points:
        result = _attempt(tmp_path, kill_after, point)
        assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    final = _attempt(tmp_path, -1, "none")
    assert final.returncode == 0, final.stderr[-2000:]
    report = json.loads(final.stdout.strip().splitlines()[-1])
    ran = len(read_ledger(tmp_path / LEDGER_FILE, report["run"]).entries)
    assert ran > 6  # killed attempts were rolled back and ran again
    assert report["steps"] == ran
    assert report["epsilon"] >= _rdp_epsilon(ran) * (1 - 1e-9)
    assert all(is_whole_checkpoint(path) for path in (tmp_path / "checkpoints").glob("*.ckpt"))


@pytest.mark.slow
def test_epsilon_after_sigkills_of_a_two_process_run_covers_every_step_that_ran(tmp_path):
    """CP 2 with sharded checkpoints; a seeded rank SIGKILLs the whole job between a step's ledger line and its
    release, before a save, once its own shards are written, and halfway through the save's state and manifest (the
    kills at a step's start and end, which a second process does not change, are the one-process test's). Every
    attempt resumes from the newest checkpoint whose manifest checks; no checkpoint name ever holds a partial folder;
    the finished run's epsilon covers every step the ledger holds. The killed attempts start both ranks at once, as
    torchrun does; the last one relaunches its script as Lightning does by default."""
    rng = random.Random(1)
    points = [(rng.randint(2, 3), "release")] + [(rng.randint(0, 1), p) for p in ("save", "mid_save", "manifest")]
    for kill_after, point in points:
        kill_rank = 0 if point == "manifest" else rng.randint(0, 1)  # rank 0 writes the save's own files
        result = _attempt(tmp_path, kill_after, point, processes=2, kill_rank=kill_rank, launched_apart=True)
        assert result.returncode == -signal.SIGKILL, (point, result.stderr[-2000:])
        checkpoints = list((tmp_path / "checkpoints").glob("*.ckpt"))
        assert all(path.is_dir() and is_whole_sharded_checkpoint(path) for path in checkpoints), point
        if point in ("mid_save", "manifest"):  # killed inside a save: its folder exists, under its temporary name
            assert list((tmp_path / "checkpoints").glob(".*.ckpt.partial")), point
    final = _attempt(tmp_path, -1, "none", processes=2)
    assert final.returncode == 0, final.stderr[-2000:]
    report = json.loads(final.stdout.strip().splitlines()[-1])
    ran = len(read_ledger(tmp_path / LEDGER_FILE, report["run"]).entries)
    assert ran > 6 and report["steps"] == ran
    assert report["epsilon"] >= _rdp_epsilon(ran) * (1 - 1e-9)


def _attempt(root, kill_after: int, point: str, processes: int = 1, kill_rank: int = 0,
             launched_apart: bool = False) -> subprocess.CompletedProcess:
    """One attempt of `ledger_crash_worker`. One process: forked from this worker's server, which imported the
    libraries once. Two: ``launched_apart``, every rank started at once by a shell, with the environment torchrun sets
    (Lightning then launches none), else rank 0 relaunching its script for the others as Lightning does."""
    arguments = [str(root), "6", str(kill_after), point, str(processes), str(kill_rank)]
    # Its temporary files go under the test's folder: a killed process removes none.
    scratch = Path(root) / "tmp"
    scratch.mkdir(exist_ok=True)
    if processes == 1:
        return _attempt_in_a_fork(arguments, scratch)
    command = [sys.executable, "-m", "tests.support.ledger_crash_worker", *arguments]
    env = {**os.environ, "TMPDIR": str(scratch)}
    if launched_apart:
        env.update(MASTER_ADDR="127.0.0.1", WORLD_SIZE=str(processes), NODE_RANK="0")
        ranks = " ".join(map(str, range(processes)))
        command = ["bash", "-c", f'for rank in {ranks}; do LOCAL_RANK=$rank RANK=$rank "$@" & done; status=0; '
                   'for job in $(jobs -p); do wait "$job" || status=$?; done; exit "$status"', "ranks", *command]
    # A session of its own: a two-process attempt kills its whole process group, never the test's.
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2],
                          start_new_session=True, env=env)


def _attempt_in_a_fork(arguments: list[str], scratch: Path) -> subprocess.CompletedProcess:
    """A one-process attempt (it kills only itself) in a process forked from this test worker's forkserver."""
    from tests.support import ledger_crash_worker

    context = forkserver_context()
    stdout, stderr = scratch / "stdout", scratch / "stderr"
    environment = {"TMPDIR": str(scratch), "MASTER_PORT": os.environ["MASTER_PORT"]}  # not the server's
    process = context.Process(target=ledger_crash_worker.run_attempt,
                              args=(arguments, str(stdout), str(stderr), environment))
    process.start()
    process.join(300)
    if process.is_alive():
        process.kill()
        process.join()
    return subprocess.CompletedProcess(arguments, process.exitcode, stdout.read_text(), stderr.read_text())


@pytest.mark.slow
def test_sigterm_saves_at_the_step_boundary_exits_cleanly_and_resumes(tmp_path):
    """SIGTERM as the fourth step starts: that step finishes, ``last.ckpt`` holds the 4 steps, the process exits with
    status 0, and the requeued run resumes from it to the end with every step accounted once."""
    first = _attempt(tmp_path, 3, "sigterm")
    assert first.returncode == 0, first.stderr[-2000:]
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 4
    final = _attempt(tmp_path, -1, "none")
    assert final.returncode == 0, final.stderr[-2000:]
    report = json.loads(final.stdout.strip().splitlines()[-1])
    assert report["steps"] == 6 == len(read_ledger(tmp_path / LEDGER_FILE, report["run"]).entries)  # none rolled back


@pytest.mark.slow
def test_sigterm_to_one_rank_of_two_stops_both_at_the_same_step_boundary(tmp_path):
    """CP 2, SIGTERM to rank 1 alone as its third step starts (Lightning's handler broadcast inside the signal handler
    while rank 0 went on into the step's all-gather: both ranks timed out, nothing was saved). Both ranks stop at
    that step's end, ``last.ckpt`` holds its 3 steps as the ledger does, both exit with status 0, and one process
    resumes from it to the end with every step accounted once."""
    first = _attempt(tmp_path, 2, "sigterm", processes=2, kill_rank=1, launched_apart=True)
    assert first.returncode == 0, first.stderr[-2000:]
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert is_whole_sharded_checkpoint(last)
    steps = torch.load(last / "meta.pt", map_location="cpu", weights_only=False)["global_step"]
    assert steps == 3 == len(read_ledger(tmp_path / LEDGER_FILE, _run_id(tmp_path)).entries)
    final = _attempt(tmp_path, -1, "none")
    assert final.returncode == 0, final.stderr[-2000:]
    report = json.loads(final.stdout.strip().splitlines()[-1])
    assert report["steps"] == 6 == len(read_ledger(tmp_path / LEDGER_FILE, report["run"]).entries)


def test_a_ledger_that_lost_the_runs_steps_is_warned_about(tmp_path):
    """The run's ledger replaced by another run's (a shared folder): it holds none of this run's steps before the
    checkpoint, so steps rolled back by the resume cannot be known. Said as loudly as a missing ledger."""
    _fit(_strategy(), tmp_path, max_steps=4)
    (tmp_path / "checkpoints" / "step=4.ckpt").unlink()
    (tmp_path / LEDGER_FILE).unlink()
    PrivacyLedger(tmp_path / LEDGER_FILE, "another-run").record(0, 1.0, 0.125)
    resumed = _strategy()
    with pytest.warns(UserWarning, match=r"privacy ledger .* lacks 2 of this run's steps before the checkpoint"):
        _fit(resumed, tmp_path, max_steps=4, ckpt_path=tmp_path / "checkpoints" / "step=2.ckpt")
    assert resumed.accountant.steps == 4


def test_a_checkpoint_moved_without_its_ledger_resumes_with_a_new_one_where_it_runs(tmp_path):
    """The checkpoint's ledger path (another machine's folder) is not recreated: the resumed run warns, keeps its
    new ledger in its own ``default_root_dir`` and accounts the steps it runs there."""
    old, new = tmp_path / "old", tmp_path / "new"
    _fit(_strategy(), old, max_steps=2)
    (new / "checkpoints").mkdir(parents=True)
    (old / "checkpoints" / "step=2.ckpt").rename(new / "checkpoints" / "step=2.ckpt")
    shutil.rmtree(old)
    resumed = _strategy()
    with pytest.warns(UserWarning, match="is missing"):
        _fit(resumed, new, max_steps=3, ckpt_path=new / "checkpoints" / "step=2.ckpt")
    assert not old.exists() and resumed.accountant.steps == 3
    assert [entry.index for entry in read_ledger(new / LEDGER_FILE, _run_id(new)).entries] == [2]


def test_a_resume_from_last_warns_when_a_newer_checkpoint_is_beside_it(tmp_path):
    """``last.ckpt`` saved at SIGTERM (step 2) is not refreshed by a ModelCheckpoint without save_last: after later
    checkpoints (4, 6) ``fit(ckpt_path="last")`` rolls back to step 2, spending the privacy of steps 2-6 again. Said,
    naming the newer checkpoint."""
    _fit(_strategy(), tmp_path, max_steps=2)
    shutil.copy(tmp_path / "checkpoints" / "step=2.ckpt", tmp_path / "checkpoints" / "last.ckpt")  # as at SIGTERM
    _fit(_strategy(), tmp_path, max_steps=6, ckpt_path=tmp_path / "checkpoints" / "last.ckpt")
    with pytest.warns(UserWarning, match=r"Resuming from .*last.ckpt, but step=6.ckpt beside it was written later"):
        _fit(_strategy(), tmp_path, max_steps=7, ckpt_path="last")


def _session_at(plan: PrivacyPlan, state=None, ledger=None) -> PrivacySession:
    """A session that releases under ``plan`` (from a checkpoint's ``state``, resumed from its ledger or
    ``ledger``, as ``privacy_ledger`` names one)."""
    session = PrivacySession(PrivacyArguments(1.0, None, DELTA, 1.0, "rdp"))
    if state is not None:
        session.load_state_dict(state)
        session.resume_from_ledger(ledger, broadcast=lambda value: value)
    session.plan = plan
    return session


def test_a_resume_reads_every_ledger_the_run_recorded_steps_in(tmp_path):
    """``privacy_ledger`` given at a resume sends the run's next steps to another file, while its earlier
    checkpoints name the first: a resume from one of them read one file only (6 of 8 steps counted, then 8 of 10,
    with a warning that the second file lacked the run's first steps)."""
    plan = PrivacyPlan(1.0, DELTA, 0.125, 4, 32, 6, None)
    first_file, second_file = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    run = _session_at(plan)
    run.noise = SimpleNamespace(tail=KEYSTREAM_TAIL)
    run.open_ledger(first_file, writer=True)
    _release(run, 2)
    at_two = run.state_dict()
    _release(run, 2)  # steps 2-3, then a crash
    run.close_ledger()
    moved = _session_at(plan, at_two, ledger=second_file)  # counts 2-3 from the first file
    moved.open_ledger(second_file, writer=True)
    _release(moved, 2)  # steps 4-5, in the second file
    moved.noise = SimpleNamespace(tail=KEYSTREAM_TAIL)
    at_six = moved.state_dict()  # names the second file
    moved.close_ledger()
    assert moved.accountant.steps == 6
    without_the_argument = _session_at(plan, at_two)
    assert without_the_argument.accountant.steps == 6 and not without_the_argument.accounting_incomplete
    without_the_argument.open_ledger(without_the_argument.ledger_path, writer=True)
    _release(without_the_argument, 2)  # steps 6-7, in the first file
    without_the_argument.close_ledger()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is missing from either file
        named = _session_at(plan, at_two, ledger=second_file)
    assert named.accountant.steps == 8 and not named.accounting_incomplete
    # The second file's checkpoint (step 6) follows its line back to the first, where steps 6-7 ran after it.
    from_second = _session_at(plan, at_six)
    assert from_second.accountant.steps == 8 and not from_second.accounting_incomplete


def _release(session: PrivacySession, steps: int) -> None:
    for _ in range(steps):
        session.record_release()
        session.accountant.step(1.0, 0.125)


def test_two_attempts_resumed_from_one_checkpoint_at_once_are_both_accounted(tmp_path):
    """Two jobs resumed from the checkpoint of step 2 at the same time (a requeued job whose old instance still runs)
    number their steps alike (2-5): a resume from one's checkpoint of step 6 dropped the other's four steps."""
    plan = PrivacyPlan(1.0, DELTA, 0.125, 4, 32, 6, None)
    run = _session_at(plan)
    run.noise = SimpleNamespace(tail=KEYSTREAM_TAIL)  # a fit's state: what a checkpoint holds
    run.open_ledger(tmp_path / LEDGER_FILE, writer=True)
    _release(run, 2)
    checkpoint = run.state_dict()
    run.close_ledger()
    first, second = _session_at(plan, checkpoint), _session_at(plan, checkpoint)
    for attempt in (first, second):
        attempt.open_ledger(attempt.ledger_path, writer=True)
        _release(attempt, 4)
        attempt.noise = SimpleNamespace(tail=KEYSTREAM_TAIL)
    later = first.state_dict()
    first.close_ledger(), second.close_ledger()
    with pytest.warns(UserWarning, match="records 4 steps of this run beside the checkpoint's own"):
        resumed = _session_at(plan, later)
    assert resumed.accountant.steps == 10 == len(read_ledger(tmp_path / LEDGER_FILE, run.run_id).entries)
    # Steps 6-9 stand for the lines beside: a resume from a later checkpoint neither counts those lines again nor
    # takes their indices, which no line names, for a truncated ledger.
    resumed.open_ledger(resumed.ledger_path, writer=True)
    _release(resumed, 2)
    resumed.noise = SimpleNamespace(tail=KEYSTREAM_TAIL)
    latest = resumed.state_dict()
    resumed.close_ledger()
    again = _session_at(plan, latest)
    assert again.accountant.steps == 12 and not again.accounting_incomplete


def test_lines_another_attempt_writes_where_a_checkpoint_counts_steps_without_lines_are_counted(tmp_path):
    """A resume that counted another attempt's steps holds them at indices no line of its own names. An attempt
    still running from an earlier checkpoint later writes its own lines at those indices: a resume took each for the
    checkpoint's own step and dropped it (16 steps ran, 14 were counted)."""
    plan = PrivacyPlan(1.0, DELTA, 0.125, 4, 32, 6, None)
    run = _session_at(plan)
    run.noise = SimpleNamespace(tail=KEYSTREAM_TAIL)
    run.open_ledger(tmp_path / LEDGER_FILE, writer=True)
    _release(run, 2)
    checkpoint = run.state_dict()
    _release(run, 2)  # steps 2-3, then a crash
    run.close_ledger()
    first, second = _session_at(plan, checkpoint), _session_at(plan, checkpoint)  # both count 2-3: at step 4
    for attempt in (first, second):
        attempt.open_ledger(attempt.ledger_path, writer=True)
        attempt.noise = SimpleNamespace(tail=KEYSTREAM_TAIL)
    _release(first, 4)  # steps 4-7
    at_eight = first.state_dict()
    _release(second, 2)  # steps 4-5, then a crash
    second.close_ledger()
    with pytest.warns(UserWarning, match="records 2 steps of this run beside"):
        third = _session_at(plan, at_eight)  # counts the second's two steps as 8-9, which no line names
    third.open_ledger(third.ledger_path, writer=True)
    third.noise = SimpleNamespace(tail=KEYSTREAM_TAIL)
    _release(first, 4)  # the first runs on: its lines 8-11
    first.close_ledger()
    _release(third, 2)  # steps 10-11
    at_twelve = third.state_dict()
    third.close_ledger()
    with pytest.warns(UserWarning, match="records 4 steps of this run beside"):
        resumed = _session_at(plan, at_twelve)
    assert resumed.accountant.steps == 16 == len(read_ledger(tmp_path / LEDGER_FILE, run.run_id).entries)


def test_a_replaced_ledger_is_noticed_when_the_run_opened_it_at_its_checkpoint(tmp_path):
    """A run without ModelCheckpoint opens its ledger at its first save: the checkpoint's own step. With nothing of
    the run before that step to look for, a ledger replaced by another run's went unnoticed and the steps after the
    checkpoint were dropped silently. The line that opened the ledger is looked for too."""
    first = make_trainer(_strategy(), max_steps=2, default_root_dir=tmp_path)
    first.fit(make_module(small_config(n_layers=1), optimizer="sgd", learning_rate=1e-2), loader(DATA, 4))
    first.save_checkpoint(tmp_path / "step2.ckpt")
    (tmp_path / LEDGER_FILE).unlink()
    PrivacyLedger(tmp_path / LEDGER_FILE, "another-run").record(0, 1.0, 0.125)
    resumed = _strategy()
    with pytest.warns(UserWarning, match="lacks the line where this run opened it at step 2"):
        make_trainer(resumed, max_steps=3, default_root_dir=tmp_path).fit(
            make_module(small_config(n_layers=1), optimizer="sgd", learning_rate=1e-2), loader(DATA, 4),
            ckpt_path=tmp_path / "step2.ckpt")
    assert resumed.privacy.accounting_incomplete


def test_a_resume_on_another_split_of_the_documents_is_warned_about(tmp_path):
    """A data module's split (its seed, val_fraction or files) changed at a resume: documents held out for
    validation now may have been trained on before, their loss released without noise. Only the dataset size was
    compared (equal here); the split's digest is kept in the plan and compared."""
    class Split(RandomTokens):
        def __init__(self, digest: str) -> None:
            super().__init__(size=32, seq_len=8)
            self.split_digest = digest

    def fit(digest: str, max_steps: int, ckpt_path=None) -> LongShieldStrategy:
        strategy = _strategy()
        checkpoints = ModelCheckpoint(dirpath=tmp_path / "checkpoints", filename="{step}", every_n_train_steps=2,
                                      save_top_k=-1)
        make_trainer(strategy, max_steps=max_steps, default_root_dir=tmp_path, enable_checkpointing=True,
                     callbacks=[checkpoints]).fit(make_module(small_config(n_layers=1)), loader(Split(digest), 4),
                                                  ckpt_path=ckpt_path)
        return strategy

    assert fit("a", max_steps=2).privacy.plan.training_digest == "a"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*another split")
        fit("a", max_steps=3, ckpt_path=tmp_path / "checkpoints" / "step=2.ckpt")
    with pytest.warns(UserWarning, match="another split of its documents .* released outside the privacy guarantee"):
        fit("b", max_steps=3, ckpt_path=tmp_path / "checkpoints" / "step=2.ckpt")


def test_a_missing_ledger_named_at_resume_points_to_the_one_the_checkpoint_names(tmp_path):
    _fit(_strategy(), tmp_path, max_steps=2)
    (tmp_path / LEDGER_FILE).rename(tmp_path / "moved.jsonl")
    resumed = _strategy(privacy_ledger=tmp_path / "elsewhere.jsonl")
    named = str(tmp_path / LEDGER_FILE)
    with pytest.warns(UserWarning, match=f"elsewhere.jsonl is missing \\(the checkpoint names {named}\\)"):
        _fit(resumed, tmp_path, max_steps=3, ckpt_path=tmp_path / "checkpoints" / "step=2.ckpt")


def test_a_ledger_named_at_resume_that_does_not_exist_yet_reads_the_checkpoints_own(tmp_path):
    """``privacy_ledger`` naming a new file while the checkpoint's ledger is in place: the steps it holds after the
    checkpoint (rolled back by this resume) were not read, and epsilon left them out (with a warning). They are read
    from the checkpoint's ledger; the run's new steps go to the named one."""
    _fit(_strategy(), tmp_path, max_steps=6)
    for step in (4, 6):
        (tmp_path / "checkpoints" / f"step={step}.ckpt").unlink()
    resumed = _strategy(privacy_ledger=tmp_path / "elsewhere.jsonl")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*[Pp]rivacy ledger")
        _fit(resumed, tmp_path, max_steps=3, ckpt_path=tmp_path / "checkpoints" / "step=2.ckpt")
    assert resumed.accountant.steps == 7 and "a lower bound" not in resumed.privacy.describe_guarantee()
    assert [entry.index for entry in read_ledger(tmp_path / "elsewhere.jsonl", _run_id(tmp_path)).entries] == [6]


def test_a_file_gone_from_beside_last_ckpt_leaves_the_resume_alone(tmp_path):
    """Another job's ModelCheckpoint removing a file while it is listed, or a dangling link: no warning to give, and
    the resume goes on (the check raised FileNotFoundError)."""
    _fit(_strategy(), tmp_path, max_steps=2)
    folder = tmp_path / "checkpoints"
    shutil.copy(folder / "step=2.ckpt", folder / "last.ckpt")
    (folder / "best.ckpt").symlink_to(folder / "gone.ckpt")
    resumed = _strategy()
    _fit(resumed, tmp_path, max_steps=3, ckpt_path="last")
    assert resumed.accountant.steps == 3


def test_a_ledger_opened_by_a_save_is_not_used_for_the_steps_of_another_runs_checkpoint(tmp_path):
    """A strategy that saved a checkpoint of its own fit (which opens its ledger) and then resumes another run's
    checkpoint records the resumed steps under that run, in its ledger: they used to go under the first run's id,
    so a later resume of the other run missed them."""
    other = tmp_path / "other"
    _fit(_strategy(), other, max_steps=2)
    first = tmp_path / "first"
    strategy = _strategy()
    trainer = make_trainer(strategy, max_steps=1, default_root_dir=first)
    module = make_module(small_config(n_layers=1), optimizer="adamw", learning_rate=1e-2)
    trainer.fit(module, loader(DATA, 4))
    trainer.save_checkpoint(first / "saved.ckpt")  # opens the ledger beside it, for this strategy's run
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(module, loader(DATA, 4), ckpt_path=other / "checkpoints" / "step=2.ckpt")
    assert strategy.privacy.run_id == _run_id(other)
    assert len(read_ledger(other / LEDGER_FILE, _run_id(other)).entries) == 4


def test_an_open_ledger_pickles_and_its_copy_appends_to_the_same_file(tmp_path):
    """A spawn launcher pickles the strategy, whose session may hold an open ledger (a save outside a fit opens it)."""
    import pickle

    ledger = PrivacyLedger(tmp_path / LEDGER_FILE, "run", opened_at=0)
    ledger.record(0, 1.0, 0.1)
    copy = pickle.loads(pickle.dumps(ledger))
    copy.record(1, 1.0, 0.1)
    ledger.close(), copy.close()
    assert [entry.index for entry in read_ledger(tmp_path / LEDGER_FILE, "run").entries] == [0, 1]


def test_a_save_after_resuming_a_finished_run_keeps_its_dp_history(tmp_path):
    """A fit resumed at its last step trains nothing (Lightning skips the loop, so training never starts): a save
    then wrote the weights without their privacy state, and a run resumed from that file started its accountant at
    0. It keeps the restored state, and epsilon is read at the restored delta. A strategy reused for such a resume
    after a fit of its own (at another noise) saves the restored run's plan, not its own."""
    for reused in (False, True):
        root = tmp_path / f"reused={reused}"
        _fit(_strategy(), root, max_steps=2)
        strategy = (LongShieldStrategy(noise_multiplier=2.0, accountant="rdp", target_delta=DELTA) if reused
                    else _strategy())
        trainer = make_trainer(strategy, max_steps=2, default_root_dir=root / "resumed")
        if reused:
            trainer.fit(make_module(small_config(n_layers=1)), loader(DATA, 4))
        trainer.fit(make_module(small_config(n_layers=1), optimizer="adamw", learning_rate=1e-2), loader(DATA, 4),
                    ckpt_path=root / "checkpoints" / "step=2.ckpt")
        assert strategy.get_epsilon() == pytest.approx(_rdp_epsilon(2))
        trainer.save_checkpoint(root / "saved.ckpt")
        state = torch.load(root / "saved.ckpt", map_location="cpu", weights_only=False)[CHECKPOINT_KEY]
        assert state["plan"]["noise_multiplier"] == 1.0 and state["run_id"] == _run_id(root)
        resumed = _strategy()
        _fit(resumed, root / "again", max_steps=3, ckpt_path=root / "saved.ckpt")
        assert resumed.accountant.steps == 3
        assert resumed.get_epsilon() == pytest.approx(_rdp_epsilon(3))
