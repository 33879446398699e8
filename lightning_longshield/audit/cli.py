"""``longshield-audit``: audit a DP training run of a preset model on the standard library's text, in one run.

    longshield-audit --target-epsilon 8 --canaries 1000 --steps 40           # white-box gradient canaries
    longshield-audit --canary-type input --noise-multiplier 0 --steps 200    # black-box input canaries
    longshield-audit --config run.yaml --canaries 2000                       # the run a longshield-train YAML gives

It trains the model once with canaries among the records (each inserted with probability 1/2), through the same
Poisson sampling, clipping and noise as every record, and prints the accountant's epsilon beside the empirical lower
bound (`audit_training`); ``--json`` prints the report as strict JSON (a non-finite number, the claimed epsilon of a
run without noise, is ``null``). Standard output holds the report alone; the training's progress goes to standard
error. The run is at the scale the flags give (by default a reduced one: the ``tiny`` preset, a few dozen steps),
which the report states. With ``--config`` the model, the training data, the strategy's arguments and ``max_steps``
are the `longshield-train` file's (``--steps`` shortens the run and the report says so), and the expected logical
batch is the run's, ``batch_size`` x data-parallel size (``trainer.devices`` x ``trainer.num_nodes`` /
``context_parallel_size``), sampled at ``batch / (N + canaries / 2)`` (the run's records and the canaries expected
in), below the run's ``batch / N``; the run's layout-only options are left out (one process),
which the report says; the model, data and privacy flags are then not taken.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Mapping
from typing import Any, Optional

import torch

from lightning_longshield.audit.run import audit_training, check_audit_inputs
from simulate.run_file import trainer_processes

#: The flags of the reduced run, which a ``--config`` file's model, data and strategy replace.
_REDUCED_RUN_FLAGS = ("preset", "batch_size", "records", "seq_len", "target_epsilon", "noise_multiplier",
                      "max_grad_norm", "target_delta", "seed")


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown, except ``None`` (those flags' help says what applies)."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="longshield-audit", description=__doc__.split("\n\n")[0],
                                     formatter_class=_DefaultsHelp)
    parser.add_argument("--config", metavar="YAML", help="audit the run a longshield-train file describes (its model,"
                        " data and privacy arguments: their flags here are refused)")
    parser.add_argument("--preset", default="tiny", help="LlamaConfig preset of the audited model")
    parser.add_argument("--canaries", type=int, default=1000, help="m: canaries, each inserted with probability 1/2")
    parser.add_argument("--canary-type", choices=("gradient", "input"), default="gradient",
                        help="white-box gradient canaries (the stronger test) or black-box input canaries (scored by"
                             " loss)")
    parser.add_argument("--magnitude", type=float, default=1.0,
                        help="a gradient canary's norm, in units of --max-grad-norm (above 1, clipping is audited)")
    parser.add_argument("--steps", type=int, help="DP steps (default 40, or the --config file's max_steps)")
    parser.add_argument("--batch-size", type=int, default=64, help="expected logical (Poisson) batch")
    parser.add_argument("--records", type=int, default=64, help="the run's own records: standard-library windows")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per record")
    privacy = parser.add_mutually_exclusive_group()
    privacy.add_argument("--target-epsilon", type=float, help="calibrate the noise to this budget (default 8)")
    privacy.add_argument("--noise-multiplier", type=float, help="sigma (0: no noise, the claim is infinite)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping bound C")
    parser.add_argument("--target-delta", type=float, default=1e-5,
                        help="delta of the audited guarantee (the reduced run's; training's default is 1/(10 N))")
    parser.add_argument("--confidence", type=float, default=0.95,
                        help="the lower bound's confidence, in (0, 1): 0.95, not 95")
    parser.add_argument("--seed", type=int, default=0, help="the model's initialisation")
    parser.add_argument("--canary-seed", type=int,
                        help="the canaries and their inclusion bits (default: OS entropy; the report gives it); the"
                             " run's noise and sampling stay fresh, so the bound varies from run to run")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--plot", metavar="PNG", help="also save the guess-accuracy curve there (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.config:
        ignored = [f"--{name.replace('_', '-')}" for name in _REDUCED_RUN_FLAGS
                   if getattr(args, name) != parser.get_default(name)]
        if ignored:
            parser.error(f"{', '.join(ignored)}: with --config the model, the data and the privacy arguments are the"
                         " file's; change them there (--steps, --canaries and the audit's own flags apply).")
    if args.canaries < 2 or (args.steps is not None and args.steps < 1) or args.records < 1:
        parser.error("--canaries must be at least 2, --steps and --records at least 1.")
    if args.batch_size < 1 or args.seq_len < 2:
        parser.error("--batch-size must be at least 1 and --seq-len at least 2.")
    if not args.config and args.batch_size > args.records + args.canaries // 2:
        parser.error(f"--batch-size {args.batch_size} is more than the records and about half the canaries"
                     f" ({args.records} + {args.canaries // 2}): the Poisson sampling rate would exceed 1. Lower"
                     " --batch-size, or raise --records or --canaries.")
    if not 0 < args.target_delta < 1:
        parser.error(f"--target-delta {args.target_delta} must be in (0, 1), e.g. 1e-5.")
    if not args.max_grad_norm > 0:
        parser.error(f"--max-grad-norm {args.max_grad_norm} must be above 0.")
    if args.noise_multiplier is not None and not args.noise_multiplier >= 0:
        parser.error(f"--noise-multiplier {args.noise_multiplier} must be at least 0 (0: no noise).")
    if args.target_epsilon is not None and not 0 < args.target_epsilon < float("inf"):
        parser.error(f"--target-epsilon {args.target_epsilon} must be a finite number above 0.")
    try:
        check_audit_inputs(args.magnitude, args.confidence)
    except ValueError as err:
        parser.error(str(err))
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    with contextlib.redirect_stdout(sys.stderr):  # the training's progress and prints: stdout holds the report alone
        run = _run_from_file(args) if args.config else _reduced_run(args)
        report = audit_training(**run, canaries=args.canaries, canary_type=args.canary_type,
                                magnitude=args.magnitude, confidence=args.confidence, seed=args.canary_seed)
    print(report.to_json() if args.json else report.summary())
    if args.plot:
        report.plot(args.plot)
    return 0


def _reduced_run(args: argparse.Namespace) -> dict[str, Any]:
    """A preset model on standard-library text, as the flags give it."""
    from lightning_longshield import CausalLMModule
    from lightning_longshield.models import LlamaConfig
    from lightning_longshield.text_data import ByteTokenizer, PackedTokenDataset, python_stdlib_corpus

    steps = args.steps if args.steps is not None else 40
    text = python_stdlib_corpus(max_bytes=args.records * (args.seq_len + 1))
    dataset = PackedTokenDataset(torch.tensor(ByteTokenizer().encode(text)), args.seq_len)
    torch.manual_seed(args.seed)
    module = CausalLMModule(LlamaConfig.from_name(args.preset), optimizer="sgd", learning_rate=0.1)
    privacy = ({"noise_multiplier": args.noise_multiplier} if args.noise_multiplier is not None
               else {"target_epsilon": args.target_epsilon if args.target_epsilon is not None else 8.0})
    scale = (f"reduced: the {args.preset} preset, {len(dataset)} records of {args.seq_len} tokens, {steps} steps"
             " (audit your own run with --config or lightning_longshield.audit.audit_training)")
    return dict(module=module, dataset=dataset, batch_size=args.batch_size, max_steps=steps, scale=scale,
                strategy_options=dict(max_grad_norm=args.max_grad_norm, target_delta=args.target_delta, **privacy))


def _run_from_file(args: argparse.Namespace) -> dict[str, Any]:
    """The model, training data, strategy arguments, steps and expected logical batch of a `longshield-train` file."""
    from lightning_longshield.cli import run_cli
    from lightning_longshield.context_parallel import resolve_parallel_sizes

    command_line, sys.argv = sys.argv, sys.argv[:1]  # the audit's own flags are not the run file's: no warning of both
    try:
        cli = run_cli(["--config", args.config, "--trainer.logger", "false", "--trainer.enable_checkpointing",
                       "false"], run=False)
    finally:
        sys.argv = command_line
    trainer = cli.config["trainer"]
    strategy = trainer.get("strategy")
    if not (hasattr(strategy, "get") and str(strategy.get("class_path", "")).endswith("LongShieldStrategy")):
        raise SystemExit(f"{args.config}: trainer.strategy must be LongShieldStrategy to audit a DP run.")
    # The run's noise_seed stays out: seeded, the audit would draw the audited run's own noise and masks again.
    options = {key: value for key, value in _arguments(strategy.get("init_args")).items()
               if value is not None and key != "noise_seed"}
    datamodule = cli.datamodule
    datamodule.setup("fit")
    configured = trainer.get("max_steps")
    if args.steps is None and (configured is None or configured < 1):
        raise SystemExit(f"{args.config}: give trainer.max_steps or --steps (the audited run's DP steps).")
    steps = args.steps if args.steps is not None else configured
    processes, counted = _processes(trainer, args.config)
    try:
        data_parallel, _ = resolve_parallel_sizes(processes, options.get("context_parallel_size"))
    except ValueError as err:
        raise SystemExit(f"{args.config}: {err}") from None
    batch_size = datamodule.batch_size * data_parallel  # the run's expected logical batch, so its sampling rate
    scale = "as configured" if steps == configured else f"reduced: {steps} of the configured {configured} steps"
    notes = [args.config, f"expected logical batch {batch_size} = batch_size {datamodule.batch_size} x"
                          f" data-parallel size {data_parallel}"] + ([counted] if counted else [])
    return dict(module=cli.model, dataset=datamodule.train_dataset, batch_size=batch_size,
                max_steps=steps, strategy_options=options, scale=f"{scale} ({'; '.join(notes)})",
                trainer_options={key: trainer[key] for key in ("accelerator", "precision")
                                 if trainer.get(key) is not None})


def _arguments(init_args: Any) -> dict[str, Any]:
    """A parsed class's ``init_args``, an argument given as a class (``norms: {class_path: ...ProjectedNorms}``)
    built as `longshield-train` builds it."""
    from lightning.pytorch.cli import instantiate_class

    arguments = init_args.as_dict() if hasattr(init_args, "as_dict") else dict(init_args or {})
    return {key: instantiate_class((), value) if isinstance(value, dict) and "class_path" in value else value
            for key, value in arguments.items()}


def _processes(trainer: Mapping[str, Any], source: str) -> tuple[int, str]:
    """The run's processes (`simulate.run_file.trainer_processes`), and a note where ``devices`` is no count or
    list (``"auto"``, ``-1``): Lightning's count for it on this machine, which the run's may differ from."""
    try:
        processes = trainer_processes(trainer, source)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    if processes is not None:
        return processes, ""
    devices, nodes = trainer.get("devices", "auto"), trainer.get("num_nodes") or 1
    try:
        import lightning.pytorch as pl

        counted = pl.Trainer(accelerator=trainer.get("accelerator") or "auto", devices=devices, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False).num_devices
    except Exception as err:  # e.g. GPUs asked for on a machine without them
        raise SystemExit(f"{source}: trainer.devices={devices!r} cannot be counted here ({err}); give it as a"
                         " count, the run's processes per node.") from None
    return counted * nodes, f"trainer.devices={devices!r} counted here as {counted}"


if __name__ == "__main__":
    sys.exit(main())
