"""``longshield-plan``: will a DP long-context run fit, how fast is it, how far can the context go.

    longshield-plan fit --model llama3.1-8b --gpus 4 --method v2 --mbs 1 --seq-len 16384
    longshield-plan max-seq --model llama3.2-1b --gpus 4 --method v3 --mbs 1
    longshield-plan compare --model llama3.1-8b --gpus 4
    longshield-plan recommend --model llama3.1-8b --gpus 4 --seq-len 16k
    longshield-plan plot --model llama3.1-8b --gpus 4 --out memory.png
    longshield-plan trace --model llama3.1-8b --method v2 --cp 4 --mbs 1 --seq-len 16384   # needs torch

``--model`` is a preset or a local Hugging Face Llama checkpoint folder (its ``config.json`` is read; no weights).
Every command takes ``--json`` and then prints exactly one JSON object.

Exit status: 0 when the command answered (``fit``: the run fits; ``max-seq``: some length fits; ``recommend``: some
configuration fits), ``EXIT_DOES_NOT_FIT`` (1) when nothing does, 2 for invalid input (with the command's usage
line).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import shlex
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points

from rich.console import Console
from rich.table import Table

from simulate import planner
from simulate.config import (
    CLIPPINGS,
    METHODS,
    PER_LAYER_KERNELS,
    PRECISIONS,
    MethodSpec,
    RunConfig,
    as_run_by_strategy,
    method_for,
    parse_gpus,
    planned_with_lora,
    zero_dp_layout,
)
from simulate.loss_chunks import LossChunking
from simulate.memory import estimate_memory
from simulate.run_file import PlannedRun, read_run_file
from simulate.specs import GPU_PRESETS, MODEL_PRESETS, get_model_spec
from simulate.strategy_config import SHARD_OVER, describe_arguments

BREAKDOWN_ROWS = (
    ("model_states", "model states (params, grads/accumulator, AdamW)"),
    ("fsdp_buffers", "FSDP unsharded params/grads"),
    ("activations", "activations"),
    ("logits_loss", "logits + fp32 cross entropy"),
    ("per_sample_grads", "per-sample gradients"),
    ("ghost_norm", "ghost norm + book-keeping"),
    ("communication", "communication buffers"),
    ("fragmentation", "allocator fragmentation"),
)
Handler = Callable[[argparse.Namespace, Console], dict]
PLUGIN_GROUP = "longshield_plan.commands"  # entry points: subcommand name -> register(add_command)
MAX_ADVISED_GPUS = 1024  # `max-seq` suggests at most this many GPUs when nothing fits
EXIT_DOES_NOT_FIT = 1  # when nothing asked about fits (argparse's usage errors exit with 2)
#: Where a run file's value of each option comes from: (the flag, the file's key).
RUN_FILE_KEYS = {
    "model": ("--model", "model.init_args.config"),
    "gpus": ("--gpus", "trainer.devices x trainer.num_nodes"),
    "precision": ("--precision", "trainer.precision"),
    "seq_len": ("--seq-len", "data.init_args.seq_len"),
    "method": ("--method", "trainer.strategy.init_args"),
    "mbs": ("--mbs", "trainer.strategy.init_args.micro_batch_size"),
    "cp": ("--cp", "trainer.strategy.init_args.context_parallel_size"),
    "shard_over": ("--shard-over", "trainer.strategy.init_args.shard_over"),
    "lora_rank": ("--lora-rank", "model.init_args.lora.rank"),
    "clipping": ("--clipping", "trainer.strategy.init_args.clipping"),
    "per_layer_kernel": ("--per-layer-kernel", "trainer.strategy.init_args.clipping.kernel"),
    "loss_chunk_tokens": ("--loss-chunk-tokens", "model.init_args.loss_chunk_tokens"),
}
V1_PROTOTYPE_NOTE = (
    "Note: --method v1 plans the paper's V1 prototype: every CP rank keeps whole per-sample gradients (at any"
    " micro-batch size) and the whole clipped sum. LongShieldStrategy(exchange='all_reduce') keeps only its shard of"
    " the clipped sum and takes V2's path at micro-batch 1; plan that with `fit --config` (a run file).")
ZERO_DP_PROTOTYPE_NOTE = (
    "Note: --method zero-dp plans the paper's ZeRO-DP+ prototype (a norm pass that retains the graph);"
    " LongShieldStrategy(norms='mixed', context_parallel_size=1, shard_over='all') runs one backward with"
    " book-keeping; plan that with `fit --config` (a run file).")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``longshield-plan`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser(argv)
    try:
        _defaults_from_run_file(parser, argv)
    except (OSError, ValueError, ImportError) as err:  # the file cannot be read, or the run would refuse it
        parser.subcommands.get(argv[0], parser).error(str(err))  # type: ignore[attr-defined]
    args = parser.parse_args(argv)
    _lay_out_book_kept_norms(args)
    console = Console(highlight=False, soft_wrap=True)
    try:
        result = args.handler(args, console)
    except (ValueError, ImportError) as err:
        args.parser.error(_with_sources(str(err), args))  # exits with status 2 and the command's usage line
    result["notes"] = [*getattr(args, "run_file_notes", ()), *result.get("notes", ())]
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        for note in result["notes"]:
            console.print(note)
    return getattr(args, "exit_status", 0)  # a handler may set it (`fit`: EXIT_DOES_NOT_FIT)


def _with_sources(text: str, args: argparse.Namespace) -> str:
    """``text`` plus, for each flag it names whose value came from the run file, the file's key."""
    sources = [f"{flag} is {args.config}'s {key}" for dest, (flag, key) in RUN_FILE_KEYS.items()
               if flag in text and getattr(args, "run_file_values", {}).get(dest, ...) == getattr(args, dest, None)]
    return f"{text} ({'; '.join(sources)})" if sources else text


# --- commands -------------------------------------------------------------------------------------------------

def _defaults_from_run_file(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """``--config run.yaml``: the ``longshield-train`` file's run becomes the command's defaults (flags given on the
    command line still win): model, LoRA rank, GPUs, precision, sequence length, the loss chunking and the strategy's
    arguments, as the planner's method (`method_for`), micro-batch size, CP size, ``shard_over`` and clipping, where
    the command takes them (``recommend`` chooses method, MBS and CP itself, over all the file's GPUs)."""
    paths = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--config"]
    paths += [arg.split("=", 1)[1] for arg in argv if arg.startswith("--config=")]
    command = parser.subcommands.get(argv[0]) if argv else None  # type: ignore[attr-defined]
    if len(paths) > 1:
        raise ValueError(f"--config given {len(paths)} times ({', '.join(paths)}); plan one run file at a time.")
    if not paths or command is None:
        return
    path = paths[0]
    run = read_run_file(path)
    strategy, lora_notes = planned_with_lora(run.strategy, run.lora_rank)
    run = dataclasses.replace(run, strategy=strategy, notes=(*run.notes, *lora_notes))
    known = {action.dest: action for action in command._actions if action.nargs not in ("+", "*")}  # not lists
    values = _run_file_values(run, path, model_given="model" in known and _given(argv, "--model"))
    method_notes = method_for(run.strategy)[1] if "method" in known else ()  # the file's own method approximated
    notes = (*run.notes, *method_notes)
    if run.gpus is None:
        notes += ("Note: the run file does not set trainer.devices (Lightning then takes every visible GPU): planned"
                  " on --gpus.",)
    values = {name: value for name, value in values.items() if (value is not None or name == "loss_chunk_tokens")
              and name in known}
    command.set_defaults(**values, as_run=True,  # the strategy's own variant of each method, not the prototype
                         norms=run.strategy.per_sample, overlap_communication=run.strategy.overlap_communication,
                         run_file_cp=run.strategy.context_parallel_size, run_file_notes=notes, run_file_values=values)
    if "seq_len" in values:
        known["seq_len"].required = False


def _given(argv: list[str], flag: str) -> bool:
    """Whether ``flag`` is on the command line (``--flag value`` or ``--flag=value``)."""
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


def _run_file_values(run: PlannedRun, path: str, model_given: bool = False) -> dict[str, object]:
    """The options a run file gives, by ``dest`` (``None``: not in the file). Book-kept norms are planned as ZeRO-DP+
    at CP 1 (on the GPUs `zero_dp_layout` names, once the command line's flags are applied). The file's model is
    checked unless ``--model`` replaces it, and must be given that way where the file's module is not the
    library's."""
    if run.model is None and not model_given:
        raise ValueError(f"{path}: model.class_path is a LightningModule of its own, whose model the planner cannot"
                         " read: give --model (a preset, such as llama3.2-1b, or a Hugging Face model folder).")
    if run.model is not None and not model_given:
        try:
            get_model_spec(run.model)
        except ValueError as err:
            raise ValueError(f"{path}: model.init_args.config={run.model!r}: {err}") from None
    strategy, per_layer = run.strategy, run.strategy.per_layer
    method = method_for(strategy)[0]
    gpus, cp, shard_over = run.gpus, strategy.context_parallel_size, strategy.shard_over
    return dict(
        model=run.model, gpus=None if gpus is None else float(gpus), precision=run.precision, seq_len=run.seq_len,
        method=method, mbs=strategy.micro_batch_size, cp=1 if method == "zero-dp" else cp, shard_over=shard_over,
        lora_rank=run.lora_rank, clipping="flat" if per_layer is None else "per_layer",
        per_layer_kernel="torch" if per_layer is None else per_layer.kernel, loss_chunk_tokens=run.loss_chunk_tokens,
    )


def _lay_out_book_kept_norms(args: argparse.Namespace) -> None:
    """A run file's book-kept norms, planned as ZeRO-DP+ at CP 1: on the GPUs and ``shard_over`` that
    `zero_dp_layout` names for the GPU count and ``shard_over`` left after the command line's flags, as the pre-flight
    check plans them."""
    if not getattr(args, "as_run", False) or getattr(args, "method", None) != "zero-dp" or args.gpus is None:
        return
    args.gpus, args.shard_over = zero_dp_layout(args.shard_over, args.run_file_cp or args.gpus, args.gpus)


def _method(args: argparse.Namespace) -> str | MethodSpec:
    """``--method`` as the planner's name, or, for a ``--config`` run, as `LongShieldStrategy` runs it."""
    if getattr(args, "as_run", False):
        return as_run_by_strategy(args.method, args.mbs, getattr(args, "norms", "mixed"),
                                  getattr(args, "overlap_communication", True))
    return args.method


def _prototype_notes(args: argparse.Namespace) -> tuple[str, ...]:
    """Where ``--method`` plans a paper prototype rather than what the strategy runs with its preset's arguments."""
    if getattr(args, "as_run", False):
        return ()
    return {"v1": (V1_PROTOTYPE_NOTE,), "zero-dp": (ZERO_DP_PROTOTYPE_NOTE,)}.get(args.method, ())


def _fit(args: argparse.Namespace, console: Console) -> dict[str, object]:
    _check_cp_splits(args.method, args.gpus, args.cp, args.seq_len)
    p = planner.plan(model=args.model, gpus=args.gpus, method=_method(args), mbs=args.mbs, seq_len=args.seq_len,
                     cp=args.cp, gpu=args.gpu, precision=args.precision, lora_rank=args.lora_rank,
                     clipping=args.clipping, per_layer_kernel=args.per_layer_kernel,
                     loss_chunk_tokens=args.loss_chunk_tokens, shard_over=args.shard_over)
    args.exit_status = 0 if p.fits else EXIT_DOES_NOT_FIT
    if not args.json:
        _print_plan(console, p)
        console.print(_strategy_line(p.config))
        if not p.fits:
            console.print(_does_not_fit_advice(p, args))
    return {**p.to_dict(), "strategy_arguments": strategy_arguments(p.config),
            "notes": [*_prototype_notes(args), *planner.plan_notes(p)]}


def strategy_arguments(cfg: RunConfig) -> dict[str, object]:
    """`LongShieldStrategy`'s arguments that run ``cfg`` as a run file's ``init_args``, the context-parallel size
    and ``shard_over`` always named."""
    return {"context_parallel_size": cfg.cp_size, "shard_over": cfg.shard_over, **cfg.strategy.as_init_args()}


def _constructor(cfg: RunConfig) -> str:
    """``LongShieldStrategy(...)`` with the arguments that run ``cfg``, as Python (the context-parallel size and
    ``shard_over`` always named)."""
    arguments = describe_arguments({"context_parallel_size": cfg.cp_size, "shard_over": cfg.shard_over,
                                    **cfg.strategy.as_arguments()})
    return f"LongShieldStrategy({arguments})"


def _strategy_line(cfg: RunConfig) -> str:
    if cfg.method.private:
        return f"Planned as {_constructor(cfg)} on {_gpus_text(cfg.num_gpus)} GPU{'s' * (cfg.num_gpus != 1)}."
    return (f"Non-private baseline, laid out as {_constructor(cfg)} on {_gpus_text(cfg.num_gpus)}"
            f" GPU{'s' * (cfg.num_gpus != 1)}.")


def _does_not_fit_advice(p: planner.Plan, args: argparse.Namespace) -> str:
    """What to run next when ``fit`` says OOM: `recommend` for the same model, GPUs and length, and activation
    checkpointing (with whether it alone fits) where the method runs without it."""
    cfg = p.config
    recommend = (f"longshield-plan recommend --model {shlex.quote(args.model)} --gpus {_gpus_text(cfg.num_gpus)}"
                 f" --seq-len {cfg.seq_len}")
    if args.gpu != "h100":
        recommend += f" --gpu {args.gpu}"
    if args.precision != "bf16-mixed":
        recommend += f" --precision {args.precision}"
    recommend += _run_flags(cfg)
    if not cfg.method.private:
        recommend += " --methods nondp-fsdp nondp-cp nondp-cp-ac"
    advice = f"Does not fit (exit status {EXIT_DOES_NOT_FIT}). For configurations that fit, run `{recommend}`"
    if not cfg.method.activation_checkpointing:
        ac = "v3" if cfg.method.private else "nondp-cp-ac"
        flags = f"--method {ac}"
        try:
            ac_cfg = cfg.replace(method=ac, cp=cfg.cp_size if cfg.method.context_parallel else None,
                                 shard_over=args.shard_over)  # as `fit ... --method v3` would plan it
            if args.cp is not None and args.cp != ac_cfg.cp_size:
                flags += f" --cp {ac_cfg.cp_size}"
            with_ac = estimate_memory(ac_cfg)
            verdict = (f"fits ({with_ac.peak_gib:.1f} GiB)" if with_ac.fits
                       else f"does not fit either ({with_ac.peak_gib:.1f} GiB)")
        except ValueError as err:
            verdict = f"is not valid here: {err}"
        advice += f"; with {flags} (activation checkpointing) this run {verdict}"
    return advice + "."


def _run_flags(cfg: RunConfig) -> str:
    """The flags of ``cfg``'s LoRA rank, clipping and loss chunking where they are not the defaults."""
    flags = f" --lora-rank {cfg.lora_rank}" if cfg.lora_rank else ""
    if cfg.clipping != "flat":
        flags += f" --clipping {cfg.clipping} --per-layer-kernel {cfg.per_layer_kernel}"
    if cfg.loss_chunk_tokens != "auto":
        flags += f" --loss-chunk-tokens {'none' if cfg.loss_chunk_tokens is None else cfg.loss_chunk_tokens}"
    return flags


def _check_cp_splits(method: str, gpus: float, cp: int | None, seq_len: int | None) -> None:
    """Refuse a context-parallel size that cannot cut the sequence into ``2 x CP`` equal chunks, naming the ``--cp``
    values that can: divisors of the GPU count that split ``seq_len`` (every power-of-two length when ``None``)."""
    if not METHODS[method].context_parallel or math.isinf(gpus):
        return
    size = cp if cp is not None else int(gpus)
    if int(gpus) % size:
        return  # make_config names that error
    if seq_len is None and not size & (size - 1) or seq_len is not None and seq_len % (2 * size) == 0:
        return
    options = planner.cp_sizes(int(gpus), seq_len)
    length = f"Sequence length {seq_len}" if seq_len is not None else "A power-of-two sequence length"
    source = "--cp" if cp is not None else f"all {int(gpus)} GPUs in one context-parallel group, the default --cp"
    fix = (f"use {' or '.join(f'--cp {n}' for n in reversed(options))} (CP divides --gpus {int(gpus)}; the"
           f" {int(gpus)} / CP groups run data-parallel)" if options
           else f"use a longer --seq-len, a multiple of {2 * size}")
    raise ValueError(f"{length} cannot be cut into 2 x CP = {2 * size} equal chunks (CP {size}: {source}); {fix}.")


def _max_seq(args: argparse.Namespace, console: Console) -> dict[str, object]:
    inputs = dict(model=args.model, gpus=args.gpus, method=_method(args), mbs=args.mbs, cp=args.cp, gpu=args.gpu,
                  precision=args.precision, lora_rank=args.lora_rank, clipping=args.clipping,
                  per_layer_kernel=args.per_layer_kernel, loss_chunk_tokens=args.loss_chunk_tokens,
                  shard_over=args.shard_over)
    _check_cp_splits(args.method, args.gpus, args.cp, None)
    best = planner.max_seq_len(**inputs)
    args.exit_status = 0 if best is not None else EXIT_DOES_NOT_FIT
    probe = planner.probe_config(**inputs)
    at_limit = best is not None and best.config.seq_len == planner.SEARCH_LIMIT
    out = {k: v for k, v in probe.inputs().items() if k != "seq_len"}
    out.update(max_seq_len=None, fits=False, peak_memory_gib=None, tokens_per_second_per_gpu=None,
               at_search_limit=at_limit, notes=list(_prototype_notes(args)))
    if best is not None:
        summary = best.to_dict()
        out.update(max_seq_len=best.config.seq_len, fits=True, peak_memory_gib=summary["peak_memory_gib"],
                   tokens_per_second_per_gpu=summary["tokens_per_second_per_gpu"], plan=summary)
    if not args.json:
        console.print(_title(probe, with_seq=False))
        if best is None:
            smallest = planner.evaluate(probe)
            console.print(f"[bold red]Nothing fits[/]: even {probe.seq_len} tokens need "
                          f"{smallest.peak_memory_gib:.1f} GiB per GPU of {probe.gpu.memory_gib:.1f} GiB; "
                          f"{_nothing_fits_advice(probe)}.")
        else:
            length = (f"at least {best.config.seq_len:,} (the search limit)" if at_limit
                      else f"{best.config.seq_len:,}")
            console.print(f"Largest power-of-two sequence length that fits: [bold green]{length}[/] "
                          f"tokens (peak {best.peak_memory_gib:.1f} GiB of {probe.gpu.memory_gib:.1f} GiB, "
                          f"{_tps(best.tokens_per_second_per_gpu)} tokens/s/GPU).")
    return out


def _nothing_fits_advice(probe: RunConfig) -> str:
    """The single changes of input that make ``probe`` (the shortest sequence) fit, as flags to try.

    Only changes the inputs leave open are tried: ``--mbs 1`` above MBS 1, activation checkpointing where it is
    off, all GPUs in one CP group, more GPUs (doubling, up to ``MAX_ADVISED_GPUS``), a GPU with more memory.
    """
    cp_method, gpus = probe.method.context_parallel, probe.num_gpus
    # Per kind of change: its name, and its options as (flags, make_config inputs); the first that fits is offered.
    kinds: list[tuple[str, list[tuple[str, dict[str, object]]]]] = []
    if probe.micro_batch_size > 1:
        kinds.append(("--mbs 1", [("--mbs 1", {"mbs": 1})]))
    if not probe.method.activation_checkpointing:
        ac = "v3" if probe.method.private else "nondp-cp-ac"
        flags = f"--method {ac} (activation checkpointing)"
        kinds.append((flags, [(flags, {"method": ac, "cp": probe.cp_size if cp_method else None})]))
    if cp_method and not math.isinf(gpus) and probe.cp_size < gpus:
        kinds.append(("a larger --cp", [(f"--cp {int(gpus)}", {"cp": int(gpus)})]))
    if not math.isinf(gpus):
        more = [int(gpus) * 2**k for k in range(1, 11) if int(gpus) * 2**k <= MAX_ADVISED_GPUS]
        kinds.append(("more GPUs", [(f"--gpus {g}" + (f" --cp {g}" if cp_method else ""),
                                     {"gpus": g, "cp": g if cp_method else None}) for g in more]))
    elif cp_method:
        kinds.append(("a larger --cp", [(f"--cp {probe.cp_size * 2**k}", {"cp": probe.cp_size * 2**k})
                                        for k in range(1, 11)]))
    bigger = sorted((name for name, g in GPU_PRESETS.items() if g.memory_gib > probe.gpu.memory_gib),
                    key=lambda name: GPU_PRESETS[name].memory_gib)
    if bigger:
        kinds.append(("a GPU with more memory", [(f"--gpu {name}", {"gpu": name}) for name in bigger]))
    inputs = {k: v for k, v in probe.inputs().items() if k != "seq_len"}
    fixes = [next((flags for flags, changes in options if _fits_shortest({**inputs, **changes})), None)
             for _, options in kinds]
    if any(fixes):
        return "try " + " or ".join(f for f in fixes if f)
    return f"no single change makes even that fit; combine {_join([name for name, _ in kinds])}"


def _join(items: list[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)


def _fits_shortest(inputs: dict[str, object]) -> bool:
    """Whether the shortest sequence the inputs allow fits (``False`` for inputs that are not valid together)."""
    try:
        return estimate_memory(planner.probe_config(**inputs)).fits
    except ValueError:
        return False


def _compare(args: argparse.Namespace, console: Console) -> dict[str, object]:
    for method in args.methods:
        _check_cp_splits(method, args.gpus, args.cp, None)
    rows = planner.compare(args.model, args.gpus, gpu=args.gpu, precision=args.precision, methods=tuple(args.methods),
                           mbs_options=tuple(args.mbs), cp=args.cp)
    records = []
    for method, mbs, p in rows:
        records.append({
            "method": method, "mbs": mbs, "cp": p.config.cp_size if p else None, "fits": p is not None,
            "max_seq_len": p.config.seq_len if p else None,
            "peak_memory_gib": round(p.peak_memory_gib, 3) if p else None,
            "tokens_per_second_per_gpu": _round(p.tokens_per_second_per_gpu) if p else None,
        })
    out = {"model": args.model, "gpus": _gpus_json(args.gpus), "gpu": args.gpu, "precision": args.precision,
           "cp": args.cp, "rows": records}
    if not args.json:
        table = Table(title=f"{args.model} on {_gpus_text(args.gpus)} x {args.gpu}: largest power-of-two T per "
                            "method and micro-batch size")
        for col in ("method", "MBS", "CP", "max T", "peak GiB", "tokens/s/GPU"):
            table.add_column(col, justify="left" if col == "method" else "right")
        for r in records:
            table.add_row(r["method"], str(r["mbs"]), _cell(r["cp"]),
                          f"{r['max_seq_len']:,}" if r["max_seq_len"] else "[red]OOM[/]",
                          _cell(r["peak_memory_gib"], "{:.1f}"), _tps(r["tokens_per_second_per_gpu"]))
        console.print(table)
    return out


def _recommend(args: argparse.Namespace, console: Console) -> dict[str, object]:
    plans = planner.recommend(args.model, args.gpus, args.seq_len, gpu=args.gpu, precision=args.precision,
                              methods=tuple(args.methods), mbs_options=tuple(args.mbs), lora_rank=args.lora_rank,
                              clipping=args.clipping, per_layer_kernel=args.per_layer_kernel,
                              loss_chunk_tokens=args.loss_chunk_tokens)
    args.exit_status = 0 if plans else EXIT_DOES_NOT_FIT
    recommendations = [{**p.to_dict(), "strategy_arguments": strategy_arguments(p.config)} for p in plans]
    out = {"model": args.model, "gpus": _gpus_json(args.gpus), "gpu": args.gpu, "precision": args.precision,
           "seq_len": args.seq_len, "fits": bool(plans), "recommendations": recommendations}
    if not args.json:
        if not plans:
            more = "" if math.isinf(args.gpus) else " or more GPUs"
            console.print(f"[bold red]No configuration fits {args.seq_len:,} tokens[/] on {_gpus_text(args.gpus)} x "
                          f"{args.gpu}; try `longshield-plan max-seq`{more}.")
            return out
        table = Table(title=f"{args.model}, T = {args.seq_len:,} on {_gpus_text(args.gpus)} x {args.gpu}: "
                            "configurations that fit, fastest first")
        for col in ("#", "method", "MBS", "CP", "shard_over", "AC", "peak GiB", "tokens/s/GPU", "DP gap"):
            table.add_column(col, justify="left" if col in ("method", "shard_over") else "right")
        for i, p in enumerate(plans, 1):
            table.add_row(str(i), p.config.method.name, str(p.config.micro_batch_size), str(p.config.cp_size),
                          p.config.shard_over,
                          "yes" if p.config.method.activation_checkpointing else "no", f"{p.peak_memory_gib:.1f}",
                          _tps(p.tokens_per_second_per_gpu), _cell(p.dp_gap, "{:.2f}"))
        console.print(table)
        console.print("#1 as the strategy's arguments (`Trainer(strategy=...)`; `--json` gives them as a run file's"
                      f" trainer.strategy.init_args):\n  {_constructor(plans[0].config)}")
    return out


def _plot(args: argparse.Namespace, console: Console) -> dict[str, object]:
    from simulate.plot import plot_memory_vs_seq_len

    if args.min_seq_len > args.max_seq_len:
        raise ValueError(f"--min-seq-len {args.min_seq_len} is above --max-seq-len {args.max_seq_len}; swap them.")
    for method in args.methods:
        _check_cp_splits(method, args.gpus, args.cp, None)
    path = plot_memory_vs_seq_len(args.out, args.model, args.gpus, tuple(args.methods), mbs=args.mbs, cp=args.cp,
                                  gpu=args.gpu, precision=args.precision, min_seq_len=args.min_seq_len,
                                  max_seq_len=args.max_seq_len)
    if not args.json:
        console.print(f"Wrote {path}")
    return {"path": str(path), "model": args.model, "gpus": _gpus_json(args.gpus), "gpu": args.gpu,
            "methods": list(args.methods), "mbs": args.mbs, "cp": args.cp, "precision": args.precision}


# --- argument parsing -----------------------------------------------------------------------------------------

def _parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longshield-plan", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{fit,max-seq,compare,recommend,plot,...}")
    parser.subcommands = sub.choices  # type: ignore[attr-defined]
    fit = add_command(sub, "fit", _fit, "verdict, peak memory breakdown, tokens/s/GPU and DP/non-DP gap")
    _add_run_args(fit, seq_len=True)
    max_seq = add_command(sub, "max-seq", _max_seq, "largest power-of-two sequence length that fits")
    _add_run_args(max_seq, seq_len=False)
    compare = add_command(sub, "compare", _compare, "methods x micro-batch sizes: max T, peak GiB, tokens/s/GPU")
    compare.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS), metavar="METHOD",
                         help="methods to compare")
    compare.add_argument("--mbs", nargs="+", type=positive_int, default=list(planner.MBS_OPTIONS),
                         help="micro-batch sizes to try")
    compare.add_argument("--cp", type=positive_int, default=None, help="CP size for CP methods (default: all GPUs)")
    recommend = add_command(sub, "recommend", _recommend, "ranked (method, MBS, CP, AC) that fit a target length")
    recommend.add_argument("--seq-len", type=sequence_length, required=True,
                           help="target T (16k and 1M ok)")
    recommend.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(planner.DP_METHODS),
                           metavar="METHOD", help="methods to consider")
    recommend.add_argument("--mbs", nargs="+", type=positive_int, default=list(planner.MBS_OPTIONS),
                           help="micro-batch sizes to try")
    _add_config_arg(recommend)
    _add_training_args(recommend)
    plot = add_command(sub, "plot", _plot, "PNG of peak memory vs sequence length per method")
    plot.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS), metavar="METHOD",
                      help="methods to plot")
    plot.add_argument("--mbs", type=positive_int, default=1, help="micro-batch size")
    plot.add_argument("--cp", type=positive_int, default=None, help="CP size for CP methods (default: all GPUs)")
    plot.add_argument("--min-seq-len", type=power_of_two, default=1024, help="shortest T plotted")
    plot.add_argument("--max-seq-len", type=power_of_two, default=262144, help="longest T plotted")
    plot.add_argument("--out", default="longshield-plan.png", help="PNG path, missing folders are created")
    for plugin in entry_points(group=PLUGIN_GROUP):
        if argv[:1] == [plugin.name]:  # import a plug-in (it may need torch) only to run it
            plugin.load()(functools.partial(add_command, sub))
        else:
            sub.add_parser(plugin.name, help=f"(plug-in; `longshield-plan {plugin.name} --help` for its options)")
    return parser


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Ends each option's help with its default (lists space-separated), unless the help already names it or there
    is none to show (required options, flags, ``None``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or action.required or default is None or default is False or default == argparse.SUPPRESS:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else "%(default)s"
        return f"{text} (default: {shown})"


def add_command(sub: argparse._SubParsersAction, name: str, handler: Handler, help_text: str,
                precisions: Sequence[str] = tuple(PRECISIONS), hardware: bool = True) -> argparse.ArgumentParser:
    """Add a subcommand with the common options (``--model``, ``--gpus``/``--gpu`` unless ``hardware=False``,
    ``--precision``, ``--json``); ``handler(args, console)`` returns the command's JSON object."""
    p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_DefaultsHelpFormatter)
    p.set_defaults(handler=handler, parser=p)
    presets = ",".join(sorted(MODEL_PRESETS))
    p.add_argument("--model", type=_model, default="llama3.1-8b", metavar=f"{{{presets}}}|DIR",
                   help="a local Hugging Face Llama checkpoint folder (DIR, its config.json), or a model preset")
    if hardware:  # `trace` measures one rank's tensors: no GPU type or count
        # A string default goes through `type` like typed input, and shows as "4" rather than "4.0" in --help.
        p.add_argument("--gpus", type=_gpus, default="4", help="GPU count, or 'inf' for the FSDP ceiling")
        p.add_argument("--gpu", choices=list(GPU_PRESETS), default="h100", help="GPU type")
    p.add_argument("--precision", choices=list(precisions), default="bf16-mixed", help="training precision")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return p


def _add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="RUN.yaml", default=None,
                   help="a longshield-train YAML file: plan its model, GPUs, precision, sequence length and strategy"
                        " arguments (flags given here override it)")


def _add_run_args(p: argparse.ArgumentParser, seq_len: bool) -> None:
    _add_config_arg(p)
    p.add_argument("--method", choices=list(METHODS), default="v2",
                   help="v2: the strategy's defaults; v3: activation_checkpointing=True; v1: the paper's V1 prototype"
                        " (per-sample gradients all-reduced over CP, whole per-sample gradients and clipped sum on"
                        " every CP rank at any micro-batch size; exchange='all_reduce' in a --config file plans the"
                        " strategy's V1); zero-dp: the paper's ZeRO-DP+ prototype (context_parallel_size=1,"
                        " shard_over='all', norms='mixed', with a retained norm pass); nondp-*: non-private baselines")
    p.add_argument("--mbs", type=positive_int, default=1, help="micro-batch size")
    p.add_argument("--cp", type=positive_int, default=None, help="CP size (default: all GPUs for CP methods)")
    p.add_argument("--shard-over", choices=list(SHARD_OVER), default=None,
                   help="LongShieldStrategy's shard_over: model states sharded over each CP group (context_parallel,"
                        " the strategy's default; below --gpus every data-parallel group holds its own copy) or over"
                        " all GPUs (all); default: context_parallel, all for zero-dp and nondp-fsdp")
    _add_training_args(p)
    if seq_len:
        p.add_argument("--seq-len", type=sequence_length, required=True,
                       help="sequence length (16k and 1M ok)")


def _add_training_args(p: argparse.ArgumentParser) -> None:
    """What is trained and how it is clipped: LoRA rank, clipping, per-layer kernel, loss chunking."""
    p.add_argument("--lora-rank", type=int, default=0,
                   help="LoRA rank on every block projection (only the adapters train); 0: full fine-tuning")
    p.add_argument("--clipping", choices=list(CLIPPINGS), default="flat",
                   help="flat (one norm per sample) or per_layer (each layer clipped and freed as it completes)")
    p.add_argument("--per-layer-kernel", choices=list(PER_LAYER_KERNELS), default="torch",
                   help="per-layer clipping of linear weights: torch (the strategy's default: per-sample gradients,"
                        " one layer at a time) or auto (the fused kernels, no per-sample gradient, where each GPU"
                        " holds whole sequences and layers: CP 1 without --shard-over all, micro-batches above 1)")
    p.add_argument("--loss-chunk-tokens", type=loss_chunking, default="auto",
                   help="CausalLMModule's chunked loss: auto (its default: chunks once the whole logits would take"
                        " over 1 GiB), none (the whole logits at once) or positions per chunk")


def loss_chunking(text: str) -> LossChunking:
    """``--loss-chunk-tokens``: ``auto``, ``none`` or a positive integer."""
    lowered = text.strip().lower()
    if lowered in ("auto", "none"):
        return None if lowered == "none" else "auto"
    if not lowered.isdigit() or int(lowered) < 1:
        raise argparse.ArgumentTypeError(f"expected auto, none or a positive number of positions, got {text!r}")
    return int(lowered)


def _model(text: str) -> str:
    """A model preset, or a folder whose ``config.json`` reads as a Llama (checked here, read again where used)."""
    try:
        get_model_spec(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _gpus(text: str) -> float:
    try:
        return parse_gpus(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (1 or more), got {text!r}")
    return int(text)


_SEQ_LEN_SUFFIXES = {"k": 2**10, "m": 2**20}  # binary, as sequence lengths are quoted: 16k = 16384, 1M = 2**20


def sequence_length(text: str) -> int:
    """A sequence length such as ``12000``, ``16k`` or ``1M`` (k and M binary), up to the planner's limit."""
    raw = text.strip().lower()
    scale = _SEQ_LEN_SUFFIXES.get(raw[-1:], 1)
    digits = raw[:-1] if scale > 1 else raw
    if not digits.isdigit() or int(digits) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive length such as 16384, 16k or 1M, got {text!r}")
    value = int(digits) * scale
    if value > planner.SEARCH_LIMIT:
        raise argparse.ArgumentTypeError(f"must be at most {planner.SEARCH_LIMIT:,} (the planner's limit, as"
                                         f" max-seq's), got {value:,}")
    return value


def power_of_two(text: str) -> int:
    """A `sequence_length` that is a power of two (the lengths `plot` steps through)."""
    value = sequence_length(text)
    if value & (value - 1):
        lower = 1 << (value.bit_length() - 1)
        given = f" ({text.strip()})" if text.strip().lower()[-1:] in _SEQ_LEN_SUFFIXES else ""
        raise argparse.ArgumentTypeError(f"must be a power of two, got {value}{given}; try {lower} or {2 * lower}")
    return value


# --- rendering ------------------------------------------------------------------------------------------------

def _print_plan(console: Console, p: planner.Plan) -> None:
    cfg, mem = p.config, p.memory
    console.print(_title(cfg, with_seq=True))
    verdict = "[bold green]FITS[/]" if p.fits else "[bold red]OOM[/]"
    console.print(f"{verdict}: peak reserved {p.peak_memory_gib:.1f} GiB + {mem.runtime / 2**30:.1f} GiB outside "
                  f"the allocator = {mem.device_total / 2**30:.1f} of {cfg.gpu.memory_gib:.1f} GiB "
                  f"(peak during {mem.phase})")
    table = Table(title="Peak memory per GPU")
    table.add_column("component")
    table.add_column("GiB", justify="right")
    gib = mem.as_gib()
    for key, label in BREAKDOWN_ROWS:
        table.add_row(label, f"{gib[key]:.2f}")
    table.add_row("[bold]peak reserved[/]", f"[bold]{gib['reserved']:.2f}[/]")
    table.add_row("CUDA context + NCCL (outside the allocator)", f"{gib['runtime']:.2f}")
    console.print(table)
    if p.step is None:
        console.print("Throughput: undefined for an infinite GPU count.")
        return
    line = f"Throughput: {_tps(p.tokens_per_second_per_gpu)} tokens/s/GPU (MFU {p.step.mfu:.1%})"
    if p.dp_gap is not None:
        line += (f"; non-DP {planner.BASELINES[cfg.method.name]}: {_tps(p.baseline_tokens_per_second)} tokens/s/GPU,"
                 f" DP/non-DP gap {p.dp_gap:.2f}x")
    console.print(line)


def _title(cfg: RunConfig, with_seq: bool) -> str:
    inputs = cfg.inputs()
    parts = [f"[bold]{inputs['model']}[/]", str(inputs["method"]), f"{inputs['gpus']} x {inputs['gpu']}",
             f"MBS {inputs['mbs']}", f"CP {inputs['cp']}"]
    if cfg.lora_rank:
        parts.append(f"LoRA rank {cfg.lora_rank}")
    if cfg.clipping != "flat":
        parts.append(f"{cfg.clipping} clipping{' (fused kernels)' if cfg.fused_linear_weights else ''}")
    parts.append(cfg.precision.name)
    if with_seq:
        parts.append(f"T {cfg.seq_len:,}")
    return " | ".join(parts)


def _tps(x: float | None) -> str:
    """Tokens/s: whole numbers from 100 up, three significant figures below."""
    if x is None:
        return "n/a"
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _cell(x: float | None, fmt: str = "{}") -> str:
    return "-" if x is None else fmt.format(x)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def _gpus_json(g: float) -> int | str:
    return "inf" if math.isinf(g) else int(g)


def _gpus_text(g: float) -> str:
    return "inf" if math.isinf(g) else str(int(g))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
