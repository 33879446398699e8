"""One-run audits of the real DP step: canaries go through Poisson sampling, clipping and noise like every record.

Soundness runs are seeded (``noise_seed`` and the canaries' seed, test-only), so each outcome is fixed; a sound
mechanism fails such a run with probability at most one minus its confidence (0.1% and 5% for the two here), and the
chosen seeds are not unlucky (deterministic). Each runs at a size and confidence whose largest reportable bound lies
above the claim, so that it could fail. A broken mechanism (clipping skipped for one parameter, or the noise left out
of the release) must be caught, and without noise the white-box audit must be strong.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

from lightning_longshield import CausalLMModule, ProjectedNorms
from lightning_longshield.audit import AuditReport, GradientCanaries, audit_training
from lightning_longshield.audit import cli as audit_cli
from lightning_longshield.audit.canaries import EXCLUDED, InputCanaries, WithCanaries, guess_candidates
from lightning_longshield.privacy.accumulator import ClippedGradientSum
from tests.support.helpers import RandomTokens, make_module, small_config

DELTA = 1e-5
QUIET = dict(enable_progress_bar=False)


def _audit(canaries: int, max_steps: int, confidence: float = 0.95, **strategy):
    module = make_module(small_config(), optimizer="sgd", learning_rate=0.1)
    return audit_training(module, RandomTokens(size=8, seq_len=16), batch_size=64, max_steps=max_steps,
                          strategy_options=dict(max_grad_norm=1.0, target_delta=DELTA, **strategy),
                          canaries=canaries, confidence=confidence, trainer_options=QUIET, seed=0)


def test_canaries_are_inserted_with_probability_one_half_and_collate_with_the_records():
    canaries = GradientCanaries(1000, seed=3)
    assert 450 < len(canaries.inserted) < 550
    module = make_module(small_config())
    canaries.place(module)
    names = dict(module.named_parameters())
    assert len(set(canaries.coordinates)) == 1000 and canaries.layer is module.model.output  # the output layer's
    assert all(name == "model.output.weight" and 0 <= offset < names[name].numel()
               for name, offset in canaries.coordinates)
    module.model.output.weight.requires_grad_(False)  # a frozen output layer: any trainable coordinate
    fallback = GradientCanaries(1000, seed=3)
    fallback.place(module)
    assert fallback.layer is None and len({name for name, _ in fallback.coordinates}) > 3
    # One record per canary whatever the bits (the sampling rate depends on the length): an excluded one's trains
    # nothing (index -1, labels ignored).
    data = WithCanaries(RandomTokens(size=4, seq_len=8), canaries)
    assert len(data) == 4 + 1000
    own = data[0]
    assert own["canary"].item() == -1
    assert [data[4 + i]["canary"].item() for i in range(1000)] == [
        i if chosen else EXCLUDED for i, chosen in enumerate(canaries.included)]
    assert all(data[4 + i].keys() == own.keys() and (data[4 + i]["labels"] == -100).all() for i in range(1000))
    assert guess_candidates(1000)[0] == (20, 0)
    # Coordinates among 10^12 (an 8B model's head has 5e8) without a permutation of them all.
    far = canaries._distinct(10**12)
    assert len(set(far)) == 1000 and all(0 <= index < 10**12 for index in far)
    assert sorted(canaries._distinct(1000)) == list(range(1000))  # as many coordinates as canaries: all of them
    fresh, other = GradientCanaries(1000), GradientCanaries(1000)  # by default the bits come from OS entropy
    assert fresh.seed != other.seed and fresh.included != other.included
    # ... not from the seed that places the canaries (which their records show); a seed given beforehand fixes both
    assert GradientCanaries(1000, seed=fresh.seed).included != fresh.included
    assert GradientCanaries(1000, seed=7).included == GradientCanaries(1000, seed=7).included
    assert all(GradientCanaries(2).seed < 2**53 for _ in range(200))  # exact as a double (JSON readers)


class RecordsWithMask(RandomTokens):
    seq_len = 8

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        record = super().__getitem__(index)
        return {**record, "attention_mask": torch.ones(8, dtype=torch.long), "position_ids": torch.arange(8) + 5}


def test_canary_records_carry_the_runs_fields_and_its_public_length():
    """An input canary's record has the fields of the run's (else they do not collate), all tokens attended and
    positions from 0 (nothing copied from the run's first record); the wrapped data keeps the public ``seq_len``."""
    inputs = InputCanaries(6, seed=1, seq_len=8, vocab_size=64)
    data = WithCanaries(RecordsWithMask(size=4, seq_len=8), inputs, inputs.record)
    assert data.seq_len == 8 and not hasattr(WithCanaries(RandomTokens(size=4, seq_len=8), inputs), "seq_len")
    canary = data[4 + inputs.inserted[0]]
    assert torch.equal(canary["input_ids"], inputs.record(inputs.inserted[0])["input_ids"])
    assert canary["attention_mask"].tolist() == [1] * 8 and canary["position_ids"].tolist() == list(range(8))
    batch = default_collate([data[0], canary, data[4 + next(i for i in range(6) if not inputs.included[i])]])
    assert batch["input_ids"].shape == (3, 8) and batch["canary"].tolist()[0] == -1


def test_the_audited_delta_is_the_guarantees_with_the_noises_cut_off():
    """The printed guarantee adds the floating-point cut-off of the noise to delta (`privacy.cut_off`); the audit
    tests the same delta. At sigma 0.2 the cut-off outweighs the target delta."""
    report = _audit(canaries=10, max_steps=1, noise_multiplier=0.2)
    assert report.steps == 1 and report.delta > 2 * DELTA
    with pytest.warns(UserWarning, match="puts the guarantee's delta at .*, 1 or more: the run has no guarantee"):
        vacuous = _audit(canaries=10, max_steps=2, noise_multiplier=0.05)
    assert (vacuous.delta, vacuous.epsilon_lower_bound, vacuous.can_refute_claim) == (1.0, 0.0, False)


def test_gradient_canaries_outside_a_layer_refuse_projected_norms_before_training():
    """A frozen output layer (LoRA) puts each canary's gradient outside any layer's call, which randomized clipping
    cannot estimate: refused with the fix before a step, not at the first sampled canary."""
    module = make_module(small_config())
    module.model.output.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="cannot estimate: audit with exact norms"):
        audit_training(module, RandomTokens(size=8, seq_len=16), batch_size=4, max_steps=1, canaries=10,
                       strategy_options=dict(noise_multiplier=1.0, norms="hutchinson"), trainer_options=QUIET)


@pytest.mark.slow
@pytest.mark.parametrize("micro_batch_size", [1, 4])
def test_without_noise_the_white_box_audit_is_strong(micro_batch_size):
    """sigma 0 (epsilon infinite): 2000 gradient canaries, 40 steps of a tiny model, lower bound >= 4 at 95%, at one
    sample per micro-batch and at four (where per-sample gradients come from the layers' captured calls). Seeded like
    the soundness runs: with fresh sampling a canary not inserted was, once in some runs, among the guesses (799 of
    800 right)."""
    report = _audit(2000, 40, noise_multiplier=0.0, micro_batch_size=micro_batch_size, noise_seed=micro_batch_size)
    assert report.claimed_epsilon == float("inf")
    assert report.epsilon_lower_bound >= 4.0, report
    assert report.correct == report.guesses


@pytest.mark.slow
@pytest.mark.parametrize("target_epsilon, micro_batch_size, confidence", [(1.0, 1, 0.999), (2.0, 4, 0.95)])
def test_the_lower_bound_never_exceeds_the_claimed_epsilon(target_epsilon, micro_batch_size, confidence):
    """1000 canaries can report at most 1.29 at 99.9% and 4.91 at 95%: above each claim, so a broken run would show
    (as the noiseless one below does). No claim of 8 is audited here: no audit of a practical size reaches it."""
    report = _audit(1000, 40, confidence=confidence, target_epsilon=target_epsilon, noise_seed=int(target_epsilon),
                    micro_batch_size=micro_batch_size)
    assert report.can_refute_claim and report.claimed_epsilon <= target_epsilon * (1 + 1e-6)
    assert report.epsilon_lower_bound <= report.claimed_epsilon, report


@pytest.mark.slow
def test_noise_left_out_of_the_release_is_caught(monkeypatch):
    """The epsilon-2 run above with no noise in the released gradient, while the accountant counts it."""
    release = ClippedGradientSum.release
    monkeypatch.setattr(ClippedGradientSum, "release",
                        lambda self, noise, noise_std, batch_size: release(self, noise, 0.0, batch_size))
    report = _audit(1000, 40, confidence=0.95, target_epsilon=2.0, noise_seed=2, micro_batch_size=4)
    assert report.epsilon_lower_bound > report.claimed_epsilon, report


@pytest.mark.slow
def test_clipping_skipped_for_one_parameter_is_caught(monkeypatch):
    """The output layer's per-sample gradients added unclipped: the canaries there (gradient 100 C) stand far out of
    the noise calibrated to epsilon 1, and the audit reports a lower bound above the claim."""
    add = ClippedGradientSum.add

    def add_output_layer_unclipped(self, grad_samples, factors):
        broken = {name: g for name, g in grad_samples.items() if name.endswith("output.weight")}
        add(self, {name: g for name, g in grad_samples.items() if name not in broken}, factors)
        if broken:
            add(self, broken, torch.ones_like(factors))

    monkeypatch.setattr(ClippedGradientSum, "add", add_output_layer_unclipped)
    module = make_module(small_config(), optimizer="sgd", learning_rate=0.1)
    report = audit_training(module, RandomTokens(size=8, seq_len=16), batch_size=64, max_steps=40,
                            strategy_options=dict(max_grad_norm=1.0, target_delta=DELTA, target_epsilon=1.0,
                                                  noise_seed=5),
                            canaries=1000, magnitude=100.0, trainer_options=QUIET)
    assert report.epsilon_lower_bound > report.claimed_epsilon, report


@pytest.mark.slow
@pytest.mark.parametrize("canary_type", ["gradient", "input"])
def test_the_audit_command_reports_claim_and_bound(canary_type, tmp_path):
    """``longshield-audit`` on the standard library's text (a reduced scale, which the report says)."""
    plot = tmp_path / "audit.png"
    command = [sys.executable, "-m", "lightning_longshield.audit.cli", "--canary-type", canary_type, "--canaries",
               "60", "--steps", "3", "--records", "8", "--seq-len", "16", "--batch-size", "16", "--json",
               "--plot", str(plot)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = _strict_json(result.stdout)
    assert report["canary_type"] == canary_type and report["m"] == 60 and report["steps"] == 3
    assert report["claimed_epsilon"] == pytest.approx(8.0, rel=1e-3)
    # 60 canaries can show at most 2.14 at 95%: the audit says it could not refute the claim of 8.
    assert 0.0 <= report["epsilon_lower_bound"] <= report["largest_reportable_bound"] < 2.2
    assert "could not detect a broken guarantee" in result.stderr and report["canary_seed"] is not None
    assert 0 < report["guesses"] <= 60 and report["scale"].startswith("reduced")
    ks = [k for k, _ in report["top_guess_accuracy"]]
    assert ks == sorted(ks) and ks[-1] == 30 and all(0 <= a <= 1 for _, a in report["top_guess_accuracy"])
    assert plot.stat().st_size > 1000  # the curve, saved


def test_the_audit_command_refuses_bad_counts(capsys):
    with pytest.raises(SystemExit):
        audit_cli.parse_args(["--canaries", "1"])
    assert "--canaries must be at least 2" in capsys.readouterr().err
    for flags, message in [(["--confidence", "95"], "write 0.95 for 95%"), (["--confidence", "1"], "outside (0, 1)"),
                           (["--magnitude", "0"], "finite number above 0"),
                           (["--magnitude", "nan"], "finite number above 0")]:
        with pytest.raises(SystemExit):
            audit_cli.parse_args(flags)
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("bad", [dict(confidence=95.0), dict(magnitude=-1.0)])
def test_bad_audit_inputs_are_refused_before_training(bad):
    module = make_module(small_config())
    with pytest.raises(ValueError, match="outside|above 0"):
        audit_training(module, RandomTokens(size=8, seq_len=16), batch_size=8, max_steps=1, canaries=10,
                       strategy_options=dict(noise_multiplier=1.0), trainer_options=QUIET, **bad)
    assert "training_step" not in module.__dict__


def test_an_audited_module_gets_its_training_step_back():
    """The audit wraps ``training_step`` to add the canaries; afterwards the module trains, or is audited, again (in
    the mode it had: input canaries are scored in evaluation mode)."""
    module = make_module(small_config(), optimizer="sgd", learning_rate=0.1)
    for canary_type in ("gradient", "input", "gradient"):
        module.train()
        report = audit_training(module, RandomTokens(size=8, seq_len=16), batch_size=8, max_steps=1, canaries=10,
                                canary_type=canary_type, strategy_options=dict(noise_multiplier=1.0),
                                trainer_options=QUIET)
        assert report.steps == 1 and "training_step" not in module.__dict__ and module.training
    assert "at 99.9% confidence" in dataclasses.replace(report, confidence=0.999).summary()
    assert report.largest_reportable_bound < report.claimed_epsilon  # 10 canaries show next to nothing
    assert "this audit could not detect a broken guarantee" in report.summary()
    # Its delta is large beside 10 canaries' reach: more of them would not help, a smaller delta would.
    assert f"delta={report.delta:.3g}" in report.summary() and "use a smaller delta" in report.summary()
    few = dataclasses.replace(report, m=1000, delta=1e-5, largest_reportable_bound=4.911, claimed_epsilon=8.0)
    assert "Use more canaries (twice as many could show up to 5.468)" in few.summary()
    # "Capped by the audit's size" only at the ceiling: a few right guesses measure a bound below it.
    capped = dataclasses.replace(few, guesses=20, correct=20, epsilon_lower_bound=4.911)
    assert "Every guess was right" in capped.summary()
    assert "Every guess was right" not in dataclasses.replace(capped, epsilon_lower_bound=1.2).summary()
    # At a fixed delta more canaries stop helping once 2 m delta dominates; an infinite claim cannot be refuted.
    crowded = dataclasses.replace(report, m=20_000, delta=1e-5, largest_reportable_bound=5.53, claimed_epsilon=8.0)
    assert "More canaries would not raise it at this delta" in crowded.summary()
    assert "no audit can show it broken" in dataclasses.replace(report, claimed_epsilon=math.inf).summary()


def test_a_head_with_a_trainable_bias_does_not_carry_the_canaries():
    """Its bias would take part of every canary's gradient (shared along the canary's row), so the canaries go
    elsewhere, one sample per micro-batch."""
    module = make_module(small_config())
    head = module.model.output
    module.model.output = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    canaries = GradientCanaries(100, seed=3)
    canaries.place(module)
    assert canaries.layer is None
    module.model.output.bias.requires_grad_(False)
    canaries.place(module)
    assert canaries.layer is module.model.output


@pytest.mark.slow
def test_the_audit_command_takes_a_longshield_train_file(tmp_path, capsys):
    """``--config``: the file's model, data, strategy arguments and steps (micro-batches of one for the canaries)."""
    config = tmp_path / "run.yaml"
    config.write_text(textwrap.dedent("""\
        model: {config: tiny, learning_rate: 0.01}
        data:
          class_path: lightning_longshield.text_data.StdlibTextDataModule
          init_args: {seq_len: 32, batch_size: 16, max_bytes: 20000}
        trainer:
          accelerator: cpu
          devices: 1
          max_steps: 3
          strategy:
            class_path: lightning_longshield.LongShieldStrategy
            init_args: {target_epsilon: 4.0, target_delta: 1.0e-5, micro_batch_size: 2}
        """))
    assert audit_cli.main(["--config", str(config), "--canaries", "40", "--json"]) == 0
    report = _strict_json(capsys.readouterr().out)
    assert report["steps"] == 3 and report["scale"].startswith("as configured")
    assert report["claimed_epsilon"] == pytest.approx(4.0, rel=1e-2) and report["delta"] == pytest.approx(1e-5)
    assert audit_cli.main(["--config", str(config), "--canaries", "40", "--steps", "2", "--json"]) == 0
    assert _strict_json(capsys.readouterr().out)["scale"].startswith("reduced: 2 of the configured 3 steps")


def _strict_json(text: str) -> dict:
    """``text`` parsed as one JSON document, refusing NaN and Infinity (as jq and other strict parsers do)."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _run_file(tmp_path, devices: object, context_parallel_size: object, max_steps: int = 2):
    config = tmp_path / "run.yaml"
    config.write_text(textwrap.dedent(f"""\
        model: {{config: tiny}}
        data:
          class_path: lightning_longshield.text_data.StdlibTextDataModule
          init_args: {{seq_len: 16, batch_size: 8, max_bytes: 3000}}
        trainer:
          accelerator: cpu
          devices: {devices}
          max_steps: {max_steps}
          strategy:
            class_path: lightning_longshield.LongShieldStrategy
            init_args: {{noise_multiplier: 1.0, target_delta: 1.0e-5, micro_batch_size: 4,
                         context_parallel_size: {context_parallel_size}, shard_over: all}}
        """))
    return str(config)


def test_a_run_files_class_arguments_are_built_as_training_builds_them(tmp_path):
    config = Path(_run_file(tmp_path, 1, 1))
    config.write_text(config.read_text().replace(
        "shard_over: all}", "shard_over: all,\n norms: {class_path: lightning_longshield.ProjectedNorms,"
                            " init_args: {estimator: hutchinson, projection_dim: 64}}}"))
    options = audit_cli._run_from_file(audit_cli.parse_args(["--config", str(config)]))["strategy_options"]
    assert options["norms"] == ProjectedNorms("hutchinson", projection_dim=64)
    assert not [key for key in options if "." in key]


def test_the_reduced_runs_flags_are_refused_beside_a_run_file(capsys):
    with pytest.raises(SystemExit):
        audit_cli.parse_args(["--config", "run.yaml", "--target-epsilon", "2", "--seq-len", "64", "--canaries", "9"])
    assert "--seq-len, --target-epsilon: with --config the model, the data and the privacy arguments are the" \
           " file's" in capsys.readouterr().err


def test_reading_a_run_file_does_not_warn_of_the_audits_own_command_line(tmp_path, monkeypatch, recwarn):
    """LightningCLI warned that args and a command line were both given, quoting the audit's own flags."""
    config = _run_file(tmp_path, 1, 1)
    monkeypatch.setattr(sys, "argv", ["longshield-audit", "--config", config, "--canaries", "40"])
    audit_cli._run_from_file(audit_cli.parse_args(["--config", config]))
    assert not [w for w in recwarn if "both args and command line arguments" in str(w.message)]
    assert sys.argv == ["longshield-audit", "--config", config, "--canaries", "40"]


def test_a_run_files_noise_seed_is_not_the_audits(tmp_path):
    """Seeded, the audit would draw the audited run's own noise and Poisson masks again: it leaves the seed out."""
    config = Path(_run_file(tmp_path, 1, 1))
    config.write_text(config.read_text().replace("noise_multiplier: 1.0,", "noise_multiplier: 1.0, noise_seed: 7,"))
    with pytest.warns(UserWarning, match="noise_seed is set"):  # the run file's own strategy, as the CLI builds it
        run = audit_cli._run_from_file(audit_cli.parse_args(["--config", str(config)]))
    assert "noise_seed" not in run["strategy_options"] and run["strategy_options"]["noise_multiplier"] == 1.0


def test_the_audit_runs_in_one_process_without_the_layout_options():
    """Context parallelism, sharding and the exchange do not change the DP mechanism: the one-process audit drops
    them, and its scale names those that would have changed the layout."""
    module = make_module(small_config(), optimizer="sgd", learning_rate=0.1)
    report = audit_training(module, RandomTokens(size=8, seq_len=16), batch_size=8, max_steps=1, canaries=10,
                            strategy_options=dict(noise_multiplier=1.0, context_parallel_size=2, shard_over="all",
                                                  exchange="reduce_scatter"),
                            trainer_options=QUIET, scale="as configured")
    assert report.steps == 1
    assert report.scale == ("as configured; in one process, without context_parallel_size=2, shard_over='all'"
                            " (layout only, not the DP mechanism)")


@pytest.mark.parametrize("devices, context_parallel_size, data_parallel",
                         [(4, 1, 4), (4, 2, 2), (2, "null", 1)])
def test_a_run_file_is_audited_at_its_expected_logical_batch(tmp_path, devices, context_parallel_size,
                                                             data_parallel):
    """The sampling rate is the run's: the logical batch is batch_size x data-parallel size (devices / CP size)."""
    args = audit_cli.parse_args(["--config", _run_file(tmp_path, devices, context_parallel_size)])
    run = audit_cli._run_from_file(args)
    assert run["batch_size"] == 8 * data_parallel and run["max_steps"] == 2
    assert run["scale"] == (f"as configured ({args.config}; expected logical batch {8 * data_parallel} = batch_size 8"
                            f" x data-parallel size {data_parallel})")


@pytest.mark.parametrize("trainer, processes", [(dict(devices=[0, 1]), 2), (dict(devices="0,1,2", num_nodes=2), 6),
                                                (dict(devices="4"), 4), (dict(devices=2, num_nodes=3), 6)])
def test_the_run_files_processes_are_its_devices_times_its_nodes(trainer, processes):
    assert audit_cli._processes(trainer, "run.yaml") == (processes, "")


def test_a_run_file_of_automatic_devices_says_how_they_were_counted(tmp_path):
    args = audit_cli.parse_args(["--config", _run_file(tmp_path, "auto", 1), "--steps", "1"])
    run = audit_cli._run_from_file(args)
    assert run["batch_size"] == 8  # Lightning's "auto" on CPU: one device
    assert run["scale"].startswith("reduced: 1 of the configured 2 steps")
    assert run["scale"].endswith("; trainer.devices='auto' counted here as 1)")
    with pytest.raises(SystemExit, match="positive divisor"):  # a layout the run itself would refuse
        audit_cli._run_from_file(audit_cli.parse_args(["--config", _run_file(tmp_path, 4, 3)]))


def test_the_audit_command_audits_a_context_parallel_run_file(tmp_path, capsys):
    """``--config`` of a two-process CP run: audited in one process, at its logical batch; ``--json`` prints strict
    JSON alone on stdout (the progress bar goes to stderr)."""
    config = _run_file(tmp_path, 4, 2, max_steps=1)
    assert audit_cli.main(["--config", config, "--canaries", "10", "--json"]) == 0
    report = _strict_json(capsys.readouterr().out)
    assert report["steps"] == 1
    assert report["scale"] == (f"as configured ({config}; expected logical batch 16 = batch_size 8 x data-parallel"
                               " size 2); in one process, without context_parallel_size=2, shard_over='all' (layout"
                               " only, not the DP mechanism)")


def test_the_json_report_of_a_run_without_noise_is_strict_json(capsys):
    """Infinite epsilon (no noise) is written as null; stdout holds the JSON document alone."""
    flags = ["--noise-multiplier", "0", "--steps", "1", "--canaries", "10", "--records", "8", "--seq-len", "16",
             "--batch-size", "8", "--json"]
    assert audit_cli.main(flags) == 0
    captured = capsys.readouterr()
    report = _strict_json(captured.out)
    assert report["claimed_epsilon"] is None and report["steps"] == 1 and report["m"] == 10
    assert "Step" not in captured.out
    unbounded = AuditReport("gradient", 10, 5, math.inf, 0.5, 0.95, DELTA, 2, 2, 1, "x")  # no reportable ceiling
    assert _strict_json(unbounded.to_json())["largest_reportable_bound"] is None


class _DictLossModule(CausalLMModule):
    """A training step that returns ``{"loss": ...}``, as Lightning (and the DP step loop) allow."""

    per_sample_mean_loss = True

    def training_step(self, batch, batch_idx):
        return {"loss": super().training_step(batch, batch_idx)}


def test_gradient_canaries_add_to_the_loss_of_a_dict_output():
    torch.manual_seed(0)
    module = _DictLossModule(small_config(), optimizer="sgd", learning_rate=0.1)
    report = audit_training(module, RandomTokens(size=8, seq_len=16), batch_size=16, max_steps=2, canaries=20,
                            strategy_options=dict(noise_multiplier=0.0, target_delta=DELTA, micro_batch_size=4),
                            trainer_options=QUIET, seed=0)
    assert report.steps == 2 and report.correct > 0


def test_fillers_are_dropped_from_batches_and_the_sampling_rate_does_not_depend_on_the_bits():
    from torch.utils.data import DataLoader

    from lightning_longshield.audit.canaries import WithoutFillers
    from lightning_longshield.audit.run import _batch_over_every_canary

    canaries = GradientCanaries(10, seed=3)
    data = WithCanaries(RandomTokens(size=4, seq_len=8), canaries)
    (batch,) = DataLoader(data, batch_size=len(data), collate_fn=WithoutFillers(data))
    assert batch["canary"].tolist() == [-1] * 4 + canaries.inserted
    (empty,) = DataLoader(torch.utils.data.Subset(data, [4 + i for i in range(10) if not canaries.included[i]]),
                          batch_size=10, collate_fn=WithoutFillers(data))
    assert empty["input_ids"].shape == (0, 8)  # only fillers drawn: a batch of no records
    assert _batch_over_every_canary(64, 8, 2000) == round(64 * 2008 / 1008)  # B / (N + m / 2) over N + m records
    assert _batch_over_every_canary(64, 8, 10) == 18  # at most every record
