"""Differentially private fine-tuning of a local Hugging Face Llama on local ``.jsonl`` text, full or with LoRA.

    python examples/finetune_hf.py --model-dir path/to/Llama-3.2-1B --data my_text.jsonl --lora-rank 8
    python examples/finetune_hf.py            # no checkpoint at hand: a tiny random one and standard-library text
    python examples/finetune_hf.py --prepare-only --output-dir finetune_hf_demo   # for configs/finetune_lora.yaml

The model is loaded from ``--model-dir`` (``config.json`` + safetensors; its tokenizer too, if it has one), each
``.jsonl`` line's ``text`` is one document, and ``--privacy-unit`` says what the guarantee protects: one document
(truncated to ``--seq-len`` + 1 tokens) or one ``--seq-len``-token sequence of concatenated documents. Logical batches
are Poisson-sampled, the noise is calibrated to ``--target-epsilon`` over ``--max-steps``, and only the LoRA
adapters train when ``--lora-rank`` > 0. The script prints the guarantee with its privacy unit and, given public
validation documents (``--val-data``; the validation loss is released without noise, so never hold out private
documents for it), the validation perplexity on them before and after training, then exports the model (adapters
merged) to ``--export-to`` as a Hugging Face directory. Everything it writes goes under ``--output-dir`` (default: a
new temporary directory, printed at the end). Without ``--model-dir`` it writes there a tiny random Llama (BPE
tokenizer trained on the standard library's source), a ``.jsonl`` of standard-library files to train on and one of
other standard-library files to validate on; that run takes a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import lightning as L

from lightning_longshield import CausalLMModule, LongShieldStrategy
from lightning_longshield.hf import model_tokenizer
from lightning_longshield.hf.demo import write_demo_llama
from lightning_longshield.local_text_data import LocalTextDataModule
from lightning_longshield.lora import LoraOptions
from lightning_longshield.progress import StepProgressBar
from lightning_longshield.text_data import python_stdlib_sources


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help, except where it is None (the help then says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_DefaultsShown)
    parser.add_argument("--model-dir", type=Path, help="local Hugging Face Llama directory (default: a tiny demo)")
    parser.add_argument("--data", type=Path, nargs="+", help=".jsonl/.txt/.parquet files (default: demo text)")
    parser.add_argument("--val-data", type=Path, nargs="+",
                        help="public validation files, released un-noised (default: demo text with the demo data,"
                             " else no validation)")
    parser.add_argument("--text-field", default="text", help="the text field of .jsonl/.parquet records")
    parser.add_argument("--privacy-unit", choices=("document", "sequence"), default="document")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sample")
    parser.add_argument("--batch-size", type=int, default=8, help="expected logical (privacy) batch size")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="samples per forward/backward (memory)")
    parser.add_argument("--max-steps", type=int, default=20, help="DP steps")
    parser.add_argument("--target-epsilon", type=float, default=8.0, help="privacy budget of the whole run")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping bound C")
    parser.add_argument("--learning-rate", type=float, default=2e-3, help="AdamW learning rate")
    parser.add_argument("--lora-rank", type=int, default=8, help="LoRA rank; 0 fine-tunes every weight")
    parser.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA scaling numerator (alpha / rank)")
    parser.add_argument("--precision", default="32-true", help="Lightning precision, e.g. 32-true or bf16-mixed")
    parser.add_argument("--accelerator", default="auto", help="Lightning accelerator: auto (a GPU if any), cpu, cuda")
    parser.add_argument("--output-dir", type=Path,
                        help="where the demo files, the tokenization cache and the export go (default: a new"
                             " temporary directory)")
    parser.add_argument("--export-to", type=Path, help="export directory (default: <output-dir>/exported)")
    parser.add_argument("--prepare-only", action="store_true",
                        help="only write the demo checkpoint and data (for examples/configs/finetune_lora.yaml)")
    return parser.parse_args(argv)


def demo_inputs(output_dir: Path, with_model: bool = True, max_files: int = 120,
                val_files: int = 12) -> tuple[Optional[Path], Path, Path]:
    """A tiny random Llama with a tokenizer (``with_model``; else None), a .jsonl with one standard-library file per
    line to train on, and one of other (public) standard-library files to validate on."""
    sources = [p for p in python_stdlib_sources() if 2_000 < p.stat().st_size < 40_000][:max_files + val_files]
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in sources]
    texts, val_texts = texts[:max_files], texts[max_files:]
    output_dir.mkdir(parents=True, exist_ok=True)
    data, val_data = output_dir / "stdlib.jsonl", output_dir / "stdlib_val.jsonl"
    for path, part in ((data, texts), (val_data, val_texts)):
        if not path.exists():
            path.write_text("".join(json.dumps({"text": text}) + "\n" for text in part))
    if not with_model:
        return None, data, val_data
    model_dir = output_dir / "tiny-llama"
    if not (model_dir / "config.json").exists():
        write_demo_llama(model_dir, texts)
    return model_dir, data, val_data


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    output_dir = args.output_dir or Path(tempfile.mkdtemp(prefix="finetune_hf_"))
    model_dir, data_files, val_files = args.model_dir, args.data, args.val_data
    written: list[Path] = []  # the demo files this run wrote or reused: only what the arguments did not give
    if model_dir is None or data_files is None:
        demo_model, demo_data, demo_val = demo_inputs(output_dir, with_model=model_dir is None)
        if model_dir is None:
            assert demo_model is not None
            model_dir = demo_model
            written.append(demo_model)
        if data_files is None:
            data_files = [demo_data]
            written.append(demo_data)
            if val_files is None:
                val_files = [demo_val]
                written.append(demo_val)
    if args.prepare_only:
        print(f"Wrote {', '.join(str(path) for path in written)}" if written else
              "Nothing to prepare: --model-dir and --data are given.")
        return
    tokenizer = model_tokenizer(model_dir, "Put the model's tokenizer files in --model-dir.")
    data = LocalTextDataModule(
        data_files=[str(path) for path in data_files], text_field=args.text_field, tokenizer=tokenizer,
        seq_len=args.seq_len, batch_size=args.batch_size, privacy_unit=args.privacy_unit,
        val_files=None if val_files is None else [str(path) for path in val_files],
        val_batch_size=args.micro_batch_size, cache_dir=str(output_dir / "cache"),
    )
    lora = LoraOptions(rank=args.lora_rank, alpha=args.lora_alpha) if args.lora_rank > 0 else None
    module = CausalLMModule(str(model_dir), lora=lora, optimizer="adamw", learning_rate=args.learning_rate)
    strategy = LongShieldStrategy(target_epsilon=args.target_epsilon, max_grad_norm=args.max_grad_norm,
                                  micro_batch_size=args.micro_batch_size)
    trainer = L.Trainer(strategy=strategy, accelerator=args.accelerator, devices=1, precision=args.precision,
                        max_steps=args.max_steps, callbacks=[StepProgressBar()], logger=False,
                        enable_checkpointing=False, default_root_dir=output_dir, num_sanity_val_steps=0,
                        check_val_every_n_epoch=None, val_check_interval=args.max_steps, log_every_n_steps=5)
    warnings.filterwarnings("ignore", ".*isinstance\\(treespec, LeafSpec\\).*")  # Lightning 2.6 on torch 2.13
    before = None
    if val_files is not None:  # the same public validation samples as after training, for a baseline
        (before,) = trainer.validate(module, datamodule=data, verbose=False)
    trainer.fit(module, datamodule=data)

    trained = "LoRA adapters" if lora else "all weights"
    print(strategy.privacy.describe_guarantee(data.describe_privacy_unit()))
    print(f"Trained: {trained} ({sum(p.numel() for p in module.parameters() if p.requires_grad):,} parameters)"
          f" of {model_dir}")
    if before is not None:
        (after,) = trainer.validate(module, datamodule=data, verbose=False)
        print(f"Validation perplexity before training: {before['val_perplexity']:.2f}"
              f" (mean sample loss {before['val_loss']:.3f})")
        print(f"Validation perplexity: {after['val_perplexity']:.2f} (mean sample loss {after['val_loss']:.3f})"
              f" after training, over the tokens of the same {len(data.val_dataset)} public validation samples")
    export_to = args.export_to or output_dir / "exported"
    module.save_pretrained(export_to)
    merged = " (adapters merged)" if args.lora_rank else ""
    print(f"Exported{merged} to {export_to}: transformers.AutoModelForCausalLM.from_pretrained loads it")
    print(f"Outputs (demo files, tokenization cache, export) are under {output_dir}")


if __name__ == "__main__":
    main()
