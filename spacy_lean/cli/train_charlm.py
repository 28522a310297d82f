"""`spacy lean train-charlm`: train a forward or backward character LM."""

import math
import os
import sys
from enum import Enum
from pathlib import Path
from typing import List, Optional

import typer
from wasabi import msg

from . import lean_cli


class Direction(str, Enum):
    forward = "forward"
    backward = "backward"


class OptimizerName(str, Enum):
    sgd = "sgd"
    adam = "adam"


@lean_cli.command("train-charlm")
def train_charlm_cli(
    # fmt: off
    texts: List[Path] = typer.Argument(..., help=(
        "UTF-8 text files or directories of them; documents separated by newlines"), exists=True),
    output_dir: Path = typer.Argument(..., help=(
        "Output directory: lm.pt (Flair format), training_state.pt, corpus/")),
    direction: Direction = typer.Option(Direction.forward, "--direction", "-d", help=(
        "forward, or backward (trained on the reversed text, as Flair does)")),
    hidden_size: int = typer.Option(1024, "--hidden-size", help="Width of the LSTM"),
    nlayers: int = typer.Option(1, "--layers", help="Number of LSTM layers"),
    embedding_size: int = typer.Option(100, "--embedding-size", help=(
        "Width of the character embeddings")),
    nout: Optional[int] = typer.Option(None, "--nout", help=(
        "Project the LSTM output to this width (Flair's nout)")),
    dropout: float = typer.Option(0.1, "--dropout", help="Dropout"),
    bptt: int = typer.Option(250, "--bptt", help=(
        "Mean sequence length (characters per stream and step)")),
    fixed_bptt: bool = typer.Option(False, "--fixed-bptt", help=(
        "Always use --bptt characters (no random lengths)")),
    batch_size: int = typer.Option(100, "--batch-size", "-b", help=(
        "Parallel streams per worker (per GPU)")),
    lr: float = typer.Option(20.0, "--lr", help="Learning rate (20 is Flair's SGD default)"),
    optimizer: OptimizerName = typer.Option(OptimizerName.sgd, "--optimizer", help=(
        "sgd (as Flair) or adam")),
    clip: float = typer.Option(0.25, "--clip", help="Clip the gradient norm to this value; 0: off"),
    epochs: int = typer.Option(1, "--epochs", help="Passes over the text"),
    max_steps: int = typer.Option(0, "--max-steps", help=(
        "Stop after this many steps in all; 0: no limit")),
    seed: int = typer.Option(0, "--seed", help="Seed for weights, dropout and sequence lengths"),
    gpu_id: Optional[int] = typer.Option(None, "--gpu-id", "-g", help=(
        "GPU id, -1 for CPU; default: a GPU when available (under torchrun: LOCAL_RANK's)")),
    resume: bool = typer.Option(False, "--resume", help=(
        "Continue the run saved in OUTPUT_DIR (any number of workers that divides its streams)")),
    checkpoint_every: int = typer.Option(1000, "--checkpoint-every", help=(
        "Save a checkpoint every N steps (and at the end); 0: only at the end")),
    log_every: int = typer.Option(50, "--log-every", help="Steps between loss reports"),
    dev: Optional[Path] = typer.Option(None, "--dev", help=(
        "Held-out text (file or directory): loss and perplexity at every checkpoint; the best "
        "model goes to best-lm.pt"), exists=True),
    dictionary_from: Optional[Path] = typer.Option(None, "--dictionary-from", help=(
        "Use the character dictionary of this Flair LM checkpoint"), exists=True, dir_okay=False),
    min_char_count: int = typer.Option(1, "--min-char-count", help=(
        "When building the dictionary: keep characters seen this often")),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads (per worker)"),
    # fmt: on
):
    """Train a character language model (Flair's LanguageModel format) on text.

    The text is encoded once into a memory-mapped file of character ids and read as
    --batch-size parallel streams (truncated BPTT). Under torchrun, each worker
    trains on its own streams with DistributedDataParallel; --batch-size is per
    worker. The checkpoint (OUTPUT_DIR/lm.pt) loads in Flair and in spacy-lean.
    """
    import torch

    from ..charlm.model import CharLM
    from ..charlm.train import train_charlm

    is_main = int(os.environ.get("RANK", "0")) == 0
    if threads is not None:
        if threads < 1:
            msg.fail(f"--threads must be >= 1, got {threads}.", exits=1)
        torch.set_num_threads(threads)
    try:
        dictionary = CharLM.load(dictionary_from).dictionary if dictionary_from else None
    except ValueError as err:  # includes a checkpoint refused as unsafe or corrupt
        msg.fail(str(err), exits=1)
    if is_main:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        what = "Resuming" if resume else "Training"
        msg.info(
            f"{what} a {direction.value} character LM in {output_dir} "
            f"({world} worker{'s' if world > 1 else ''})"
        )
    try:
        result = train_charlm(
            texts,
            output_dir,
            is_forward_lm=direction == Direction.forward,
            hidden_size=hidden_size,
            nlayers=nlayers,
            embedding_size=embedding_size,
            nout=nout,
            dropout=dropout,
            bptt=bptt,
            batch_size=batch_size,
            lr=lr,
            optimizer=optimizer.value,
            clip=clip,
            max_epochs=epochs,
            max_steps=max_steps or None,
            seed=seed,
            gpu_id=gpu_id,
            resume=resume,
            checkpoint_every=checkpoint_every,
            log_every=log_every,
            dictionary=dictionary,
            min_char_count=min_char_count,
            randomize_bptt=not fixed_bptt,
            dev_texts=[dev] if dev is not None else None,
            progress=is_main,
        )
    except (ValueError, FileNotFoundError) as err:
        msg.fail(str(err), exits=1)

    if is_main:
        if result.losses:
            loss = result.losses[-1][1]
            msg.good(
                f"{result.step} steps, epoch {result.epoch}: loss {loss:.4f}, "
                f"perplexity {math.exp(min(loss, 50.0)):.2f} ({result.seconds:.1f}s)"
            )
        if result.dev_losses:
            best_step, best = min(result.dev_losses, key=lambda item: item[1])
            msg.good(
                f"Dev: loss {result.dev_losses[-1][1]:.4f}; best {best:.4f} (perplexity "
                f"{math.exp(min(best, 50.0)):.2f}) at step {best_step}, in "
                f"{output_dir / 'best-lm.pt'}"
            )
        msg.good(f"Saved the LM to {output_dir / 'lm.pt'}")
    if result.stopped_by is not None:  # every worker, after the same step
        from ..training.stopping import STOPPED_EXIT_CODE, ignore_ctrl_c, signal_name

        ignore_ctrl_c()  # saved: nothing is left to stop
        if is_main:
            msg.warn(
                f"Stopped by {signal_name(result.stopped_by)} after step {result.step}, with "
                f"that step saved in {output_dir}: continue with the same command and --resume."
            )
        sys.exit(STOPPED_EXIT_CODE)
