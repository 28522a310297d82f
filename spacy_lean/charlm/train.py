"""Training a character language model (forward or backward), lean and resumable.

The text is encoded once into a memory-mapped id file (`loader.encode_texts`) and
read as parallel streams by `CharLMLoader` (truncated BPTT, the hidden state carried
from batch to batch). A run writes into its output directory:

- `lm.pt`: the model, a Flair-format `LanguageModel` checkpoint (`CharLM.save`),
  usable by `FlairEmbeddings`, `CharLM.load` and spacy-lean's `char_lm` component;
- `training_state.pt`: what a resumed run needs beyond the model: optimizer state,
  loader position, the hidden state of every stream, the step and the settings;
- `corpus/`: the encoded text (`ids.bin`, `ids.json`), reused when it still matches.

Started by `torchrun` (environment `RANK`, `WORLD_SIZE`, `LOCAL_RANK`), or inside
an initialised `torch.distributed` process group, the model is wrapped in
`DistributedDataParallel` (nccl on GPUs, gloo on CPU) and each worker reads its own
share of the streams. The loader state and the hidden states are saved for all
streams, so a checkpoint resumes on any number of workers that divides the number
of streams.
"""

import hashlib
import json
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy
import torch
from torch.nn import functional as F

from ..training.stopping import TRAINING_STOP_SIGNALS, StopRequest, say_stopping
from . import safe_torch
from .loader import CharLMLoader, EncodedText, build_dictionary, encode_texts, expand_paths
from .model import CharDictionary, CharLM

PathLike = Union[str, Path]
Hidden = Tuple[torch.Tensor, ...]

MODEL_FILE = "lm.pt"
BEST_MODEL_FILE = "best-lm.pt"
STATE_FILE = "training_state.pt"
CORPUS_DIR = "corpus"
DEV_CORPUS_DIR = "dev_corpus"
TRAIN_STATE_VERSION = 1
OPTIMIZERS = ("sgd", "adam")


@dataclass
class CharLMTrainResult:
    """What `train_charlm` returns (on every worker)."""

    model: CharLM
    step: int
    epoch: int
    losses: List[Tuple[int, float]] = field(default_factory=list)
    output_dir: Optional[Path] = None
    seconds: float = 0.0
    dev_losses: List[Tuple[int, float]] = field(default_factory=list)
    # The signal (SIGTERM) that stopped the run early, after `step`, with that step saved.
    stopped_by: Optional[int] = None

    @property
    def perplexities(self) -> List[Tuple[int, float]]:
        return [(step, math.exp(min(loss, 50.0))) for step, loss in self.losses]


@dataclass
class _Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()


def _setup_distributed(device: Optional[torch.device]) -> _Dist:
    """Join the process group (already initialised, or from torchrun's environment)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return _Dist(
            dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), False
        )
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return _Dist()
    if not dist.is_available():  # pragma: no cover
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed.")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and (device is None or device.type == "cuda")
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return _Dist(dist.get_rank(), dist.get_world_size(), local_rank, True)


def resolve_device(gpu_id: Optional[int], local_rank: int = 0) -> torch.device:
    """`gpu_id` None: a GPU when one is available (under torchrun, the one of
    LOCAL_RANK); -1: the CPU; k >= 0: GPU k (local rank added under torchrun)."""
    if gpu_id is not None and gpu_id < 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if gpu_id is not None:
            raise ValueError(f"--gpu-id {gpu_id} was given, but CUDA is not available.")
        return torch.device("cpu")
    return torch.device("cuda", (gpu_id or 0) + local_rank)


def _to_device(array, device: torch.device) -> torch.Tensor:
    """Ids as an int64 tensor on `device`. The narrow ids travel as they are (uint16
    via int32, which every device supports, converted by numpy: torch before 2.3 has
    no uint16 and refuses such an array); the result is always a copy, so the loader
    may reuse its buffer for the next batch."""
    if array.dtype == numpy.uint16:
        array = array.astype(numpy.int32)
    return torch.from_numpy(array).to(device).long()


def _detach(hidden: Hidden) -> Hidden:
    return tuple(h.detach() for h in hidden)


def _step_seed(seed: int, step: int, rank: int) -> int:
    # Dropout masks depend only on (seed, step, rank): an interrupted run that is
    # resumed draws exactly the masks the uninterrupted run draws.
    return (seed * 1_000_003 + step * 7_919 + rank * 104_729) % (2**63 - 1)


def _gather_hidden(hidden: Hidden, dist: _Dist) -> List[torch.Tensor]:
    """The hidden state of all streams, `[nlayers, n_streams, hidden]` per tensor, on CPU."""
    out = []
    for h in hidden:
        if dist.enabled:
            parts = [torch.empty_like(h) for _ in range(dist.world_size)]
            torch.distributed.all_gather(parts, h.contiguous())
            h = torch.cat(parts, dim=1)
        out.append(h.detach().cpu())
    return out


def _names(paths: Sequence[PathLike]) -> str:
    """The text files, for messages (the first few)."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    shown = ", ".join(str(p) for p in paths[:3])
    return shown + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def _make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}.")


def train_charlm(
    texts: Sequence[PathLike],
    output_dir: PathLike,
    *,
    is_forward_lm: bool = True,
    hidden_size: int = 1024,
    nlayers: int = 1,
    embedding_size: int = 100,
    nout: Optional[int] = None,
    dropout: float = 0.1,
    bptt: int = 250,
    batch_size: int = 100,
    lr: float = 20.0,
    optimizer: str = "sgd",
    clip: float = 0.25,
    max_epochs: int = 1,
    max_steps: Optional[int] = None,
    seed: int = 0,
    gpu_id: Optional[int] = None,
    resume: bool = False,
    checkpoint_every: int = 1000,
    log_every: int = 50,
    dictionary: Optional[CharDictionary] = None,
    min_char_count: int = 1,
    randomize_bptt: bool = True,
    dev_texts: Optional[Sequence[PathLike]] = None,
    progress: bool = True,
) -> CharLMTrainResult:
    """Train a character LM on text files; save a Flair-format checkpoint.

    texts (Sequence[PathLike]): UTF-8 text files (or directories of them), read in
        order; documents are separated by newlines.
    output_dir (PathLike): Where `lm.pt`, `training_state.pt` and `corpus/` go.
    is_forward_lm (bool): False trains a backward LM on the reversed text.
    hidden_size, nlayers, embedding_size, nout, dropout: The model (see `CharLM`);
        ignored on resume (the checkpoint's are used).
    bptt (int): Mean number of characters per batch and stream.
    batch_size (int): Streams per batch on each worker (the global number of
        streams is batch_size x workers). On resume: derived from the checkpoint.
    lr (float): Learning rate (Flair's default for SGD: 20).
    optimizer (str): "sgd" (as Flair) or "adam".
    clip (float): Gradient norm clipping (Flair: 0.25); 0 turns it off.
    max_epochs (int): Passes over the text.
    max_steps (Optional[int]): Stop after this many steps in all (counting the
        steps of the run that is resumed).
    seed (int): Seed for the initial weights, dropout and sequence lengths.
    gpu_id (Optional[int]): None: GPU when available; -1: CPU; k: GPU k.
    resume (bool): Continue from `output_dir`'s `training_state.pt`.
    checkpoint_every (int): Save every N steps (and always at the end); 0: only at
        the end.
    log_every (int): Steps between loss records (and progress-bar updates).
    dictionary (Optional[CharDictionary]): Character dictionary; built from the
        texts when not given (`min_char_count`).
    randomize_bptt (bool): Draw sequence lengths around `bptt` (else always bptt).
    dev_texts (Optional[Sequence[PathLike]]): Held-out text, evaluated at every
        checkpoint (loss per character); the best model so far is also written to
        `best-lm.pt`.
    progress (bool): Show progress bars (main worker only).
    RETURNS (CharLMTrainResult): The trained model (unwrapped), the step count and
        the recorded mean losses (averaged over workers).
    """
    output_dir = Path(output_dir)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}.")
    # A run is refused here what its resume would refuse (`_check_resume_state`).
    for key, value in (("lr", lr), ("clip", clip), ("seed", seed)):
        ok, expected = _SETTING_CHECKS[key]
        if not ok(value):
            raise ValueError(f"{key} must be {expected}, got {value}.")
    if type(batch_size) is not int or batch_size < 1 or type(bptt) is not int or bptt < 1:
        raise ValueError(f"batch_size and bptt must be >= 1, got {batch_size} and {bptt}.")
    if max_steps is not None and max_steps < 0:
        raise ValueError(f"max_steps must be >= 0, got {max_steps}.")
    if not _whole(max_epochs, 1):
        # 0 trained nothing, saved the untrained model and reported success.
        raise ValueError(f"max_epochs (--epochs) must be a whole number >= 1, got {max_epochs}.")
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"The output folder {output_dir} is a file: give a folder's path.")
    if checkpoint_every < 0 or log_every < 1:
        raise ValueError(
            "checkpoint_every must be >= 0 and log_every >= 1, got "
            f"{checkpoint_every}, {log_every}."
        )
    requested = None if gpu_id is None or gpu_id >= 0 else torch.device("cpu")
    dist = _setup_distributed(requested)
    try:
        device = resolve_device(gpu_id, dist.local_rank if dist.enabled else 0)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        trainer = _Trainer.create(
            texts,
            output_dir,
            dist=dist,
            device=device,
            resume=resume,
            seed=seed,
            model_kwargs=dict(
                is_forward_lm=is_forward_lm,
                hidden_size=hidden_size,
                nlayers=nlayers,
                embedding_size=embedding_size,
                nout=nout,
                dropout=dropout,
            ),
            loader_kwargs=dict(bptt=bptt, batch_size=batch_size, randomize=randomize_bptt),
            optimizer=optimizer,
            lr=lr,
            clip=clip,
            dictionary=dictionary,
            min_char_count=min_char_count,
            dev_texts=dev_texts,
            progress=progress,
        )
        if resume:
            trainer.check_work_left(max_epochs, max_steps)
        return trainer.run(
            max_epochs=max_epochs,
            max_steps=max_steps,
            checkpoint_every=checkpoint_every,
            log_every=log_every,
            progress=progress,
        )
    finally:
        if dist.owns_group:
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


class _Trainer:
    def __init__(
        self,
        model: CharLM,
        loader: CharLMLoader,
        optimizer: torch.optim.Optimizer,
        *,
        output_dir: Path,
        dist: _Dist,
        device: torch.device,
        seed: int,
        clip: float,
        config: Dict[str, Any],
        dev: Optional[EncodedText] = None,
    ) -> None:
        self.model = model
        self.loader = loader
        self.optimizer = optimizer
        self.output_dir = output_dir
        self.dist = dist
        self.device = device
        self.seed = seed
        self.clip = clip
        self.config = config
        self.step = 0
        self.hidden: Optional[Hidden] = None
        self.losses: List[Tuple[int, float]] = []
        # Sum and count of the losses since the last record (kept across a resume).
        self.pending: List[float] = [0.0, 0.0]
        self.dev = dev
        self.dev_losses: List[Tuple[int, float]] = []
        self.postfix: Dict[str, str] = {}
        self.bar: Optional[Any] = None  # tqdm progress bar, main worker only
        if dist.enabled:
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [device.index] if device.type == "cuda" else None
            self.net: torch.nn.Module = DistributedDataParallel(model, device_ids=device_ids)
        else:
            self.net = model

    @classmethod
    def create(
        cls,
        texts: Sequence[PathLike],
        output_dir: Path,
        *,
        dist: _Dist,
        device: torch.device,
        resume: bool,
        seed: int,
        model_kwargs: Dict[str, Any],
        loader_kwargs: Dict[str, Any],
        optimizer: str,
        lr: float,
        clip: float,
        dictionary: Optional[CharDictionary],
        min_char_count: int,
        dev_texts: Optional[Sequence[PathLike]],
        progress: bool,
    ) -> "_Trainer":
        state: Optional[Dict[str, Any]] = None
        if resume:
            state_path = output_dir / STATE_FILE
            if not state_path.exists() or not (output_dir / MODEL_FILE).exists():
                raise FileNotFoundError(
                    f"Cannot resume: no {STATE_FILE} and {MODEL_FILE} in {output_dir}. "
                    "Run without --resume to start training."
                )
            # Restricted: tensors and plain containers only, nothing in it can run code.
            state = safe_torch.load(
                state_path, safe_torch.allowed_globals(), what="a train-charlm training state"
            )
            if not isinstance(state, dict) or state.get("version") != TRAIN_STATE_VERSION:
                raise ValueError(f"Unsupported training state version in {state_path}.")
            expected = state.get("model_sha256")
            if expected is not None and _sha256(output_dir / MODEL_FILE) != expected:
                raise ValueError(
                    f"Cannot resume: {output_dir / MODEL_FILE} is not the model that "
                    f"{state_path} was saved with (the run was stopped while it saved the "
                    "two). Train again without --resume."
                )
            model = CharLM.load(output_dir / MODEL_FILE, map_location="cpu")
            if model.is_forward_lm != model_kwargs["is_forward_lm"]:
                have = "forward" if model.is_forward_lm else "backward"
                raise ValueError(
                    f"The checkpoint in {output_dir} is a {have} LM; resume it with "
                    f"--direction {have}."
                )
            dictionary = model.dictionary
            optimizer = state["config"]["optimizer"]
        else:
            output_dir.mkdir(parents=True, exist_ok=True)
            if dictionary is None:
                dictionary = _shared_dictionary(texts, min_char_count, dist, progress)
            torch.manual_seed(seed)
            try:
                model = CharLM(dictionary, **model_kwargs)
            except RuntimeError as err:
                if "can't allocate memory" not in str(err) and "out of memory" not in str(err):
                    raise
                raise ValueError(
                    "Not enough memory for a model of hidden size "
                    f"{model_kwargs['hidden_size']}, {model_kwargs['nlayers']} layer(s) and "
                    f"embeddings of {model_kwargs['embedding_size']}: "
                    f"{str(err).splitlines()[0][:160]}. Lower --hidden-size, --layers or "
                    "--embedding-size."
                ) from None
        if not model.has_decoder:
            raise ValueError("Cannot train a character LM without its decoder (has_decoder=False).")
        encoded = _shared_encoding(texts, dictionary, output_dir / CORPUS_DIR, dist, progress)
        text_sha256 = _shared_texts_sha256(texts, dist)
        dev = None
        if dev_texts:
            dev_dir = output_dir / DEV_CORPUS_DIR
            dev = _shared_encoding(
                dev_texts, dictionary, dev_dir, dist, progress, what="dev text (--dev)"
            )
            if len(dev) - 1 < dist.world_size:
                raise ValueError(
                    f"The dev text ({_names(dev_texts)}: {len(dev)} characters) is too short "
                    f"for {dist.world_size} worker(s): each needs at least one character and "
                    "its target. Give --dev a longer text."
                )
        batch_size = loader_kwargs["batch_size"]
        loader_settings = dict(bptt=loader_kwargs["bptt"], randomize=loader_kwargs["randomize"])
        if state is None:
            if len(dictionary) < 2:  # only <unk>: every character would be unknown
                raise ValueError(
                    f"min_char_count = {min_char_count} keeps no character of the training "
                    f"text ({_names(texts)}): each appears fewer times. Lower "
                    "--min-char-count (default 1)."
                )
            limit = _batch_ids_limit(len(encoded))
            per_batch = loader_kwargs["bptt"] * batch_size * dist.world_size
            if per_batch > limit:
                raise ValueError(
                    f"bptt x batch size x workers = {per_batch:,} ids a batch, more than "
                    f"{limit:,} (the text's length, or 10 million if more): no sequence is "
                    "longer than the text. Lower --bptt or --batch-size."
                )
        else:
            _check_resume_state(state, output_dir / STATE_FILE, len(encoded), model)
            saved_sha256 = state["config"].get("text_sha256")
            if saved_sha256 is not None and saved_sha256 != text_sha256:
                then = state["config"].get("texts")
                then = ", ".join(map(str, then)) if isinstance(then, list) else "another text"
                raise ValueError(
                    f"Cannot resume: the training text ({_names(texts)}) is not the one the "
                    f"checkpoint in {output_dir} was trained on ({then[:300]}): the same "
                    "number of characters, others among them. Resume with that text, or "
                    "train again without --resume (into another output folder to keep this "
                    "one)."
                )
            batch_size = CharLMLoader.batch_size_for(state["loader"], dist.world_size)
            saved = state["config"]
            loader_settings = dict(bptt=saved["bptt"], randomize=saved["randomize"])
            seed, clip, lr = saved["seed"], saved["clip"], saved["lr"]
        n_streams = batch_size * dist.world_size
        if (len(encoded) - 1) // n_streams < 1:
            # The loader's own message knows nothing of the files or the option.
            fits = (len(encoded) - 1) // dist.world_size
            fix = (
                f"Use --batch-size {fits} or less (batch_size={fits}), or give it more text."
                if fits >= 1 and state is None
                else "Give it more text."
            )
            raise ValueError(
                f"The training text ({_names(texts)}: {len(encoded)} characters, file "
                f"delimiters included) is too short for {n_streams} streams (batch size "
                f"{batch_size} x {dist.world_size} worker(s)): each stream needs at least one "
                f"character and its target, so at least {n_streams + 1} characters. {fix}"
            )
        loader = CharLMLoader(
            encoded,
            batch_size,
            reverse=not model.is_forward_lm,
            seed=seed,
            rank=dist.rank,
            world_size=dist.world_size,
            **loader_settings,
        )
        model.to(device)
        model.train()
        opt = _make_optimizer(optimizer, model.parameters(), lr)
        config = {
            "optimizer": optimizer,
            "lr": lr,
            "clip": clip,
            "seed": seed,
            **loader_settings,
            "n_streams": loader.n_streams,
            "texts": [str(t) for t in texts],
            "text_sha256": text_sha256,
        }
        trainer = cls(
            model,
            loader,
            opt,
            output_dir=output_dir,
            dist=dist,
            device=device,
            seed=seed,
            clip=clip,
            config=config,
            dev=dev,
        )
        if state is not None:
            trainer._restore(state)
        elif dist.is_main:
            # An earlier run's best model would sit beside this run's (without --dev this
            # run writes none): it is not this run's. Removed only once every check has
            # passed, so a refused run leaves the folder as it was.
            (output_dir / BEST_MODEL_FILE).unlink(missing_ok=True)
        return trainer

    def _restore(self, state: Dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.losses = [(int(s), float(v)) for s, v in state["losses"]]
        self.pending = [float(v) for v in state["pending_loss"]]
        self.dev_losses = [(int(s), float(v)) for s, v in state.get("dev_losses", [])]
        if state["hidden"] is not None:
            rows = self.loader.rows()
            self.hidden = tuple(h[:, rows].contiguous().to(self.device) for h in state["hidden"])

    def check_work_left(self, max_epochs: int, max_steps: Optional[int]) -> None:
        """A resumed run with nothing left to train is refused, saying how to go on (it
        returned the checkpoint unchanged, silently: a resume with the default of one
        epoch after a run of two trained nothing)."""
        where = f"The checkpoint in {self.output_dir} is at step {self.step:,}"
        if max_steps is not None and self.step >= max_steps:
            raise ValueError(
                f"{where}, and this run's max_steps (--max-steps) is {max_steps:,}: nothing "
                f"is left to train. Pass a larger one (e.g. --max-steps {2 * self.step:,}) "
                "to go on."
            )
        # A checkpoint saved after an epoch's last batch, before the loader moved on to
        # the next (a step or SIGTERM stop there, or a run ended by its epochs whose last
        # save was that step), holds the epoch unfinished at its end: it counts as done.
        loader = self.loader
        epochs = loader.epoch + (loader.offset >= loader.stream_len)
        if epochs >= max_epochs:
            raise ValueError(
                f"{where} after {epochs} full pass(es) over the text, and this run's "
                f"max_epochs (--epochs) is {max_epochs}: nothing is left to train (the "
                f"limits count from the start of training, not from the resume). Pass "
                f"--epochs {epochs + 1} or more to go on."
            )

    def run(
        self,
        *,
        max_epochs: int,
        max_steps: Optional[int],
        checkpoint_every: int,
        log_every: int,
        progress: bool,
    ) -> CharLMTrainResult:
        loader = self.loader
        vocab_size = len(self.model.dictionary)
        if progress and self.dist.is_main:
            from tqdm import tqdm

            total = max_epochs * loader.approx_batches_per_epoch
            if max_steps is not None:
                total = min(total, max_steps)
            self.bar = tqdm(
                total=total, initial=min(self.step, total), unit="step", desc="Training"
            )
        loss_sum = torch.tensor(self.pending[0], device=self.device)
        n_summed = int(self.pending[1])
        last_saved = self.step
        start = time.perf_counter()

        def done() -> bool:
            return max_steps is not None and self.step >= max_steps

        # SIGTERM (a scheduler's stop) or Ctrl-C: stop after the step, saved. Workers
        # agree on the step through the loss report's all-reduce (every log_every
        # steps); one worker stops at the step it sees the signal.
        stopped = False
        on_signal = say_stopping(self.output_dir) if self.dist.is_main else None
        with StopRequest(TRAINING_STOP_SIGNALS, on_signal=on_signal) as stop:
            try:
                while loader.epoch < max_epochs and not done() and not stopped:
                    if loader.offset == 0 or self.hidden is None:
                        self.hidden = self.model.init_hidden(loader.batch_size)
                    for x_np, y_np in loader:
                        x = _to_device(x_np, self.device)
                        y = _to_device(y_np, self.device)
                        torch.manual_seed(_step_seed(self.seed, self.step, self.dist.rank))
                        logits, _, hidden = self.net(x, _detach(self.hidden))
                        loss = F.cross_entropy(logits.reshape(-1, vocab_size), y.reshape(-1))
                        self.optimizer.zero_grad(set_to_none=True)
                        loss.backward()
                        if self.clip > 0:
                            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
                        self.optimizer.step()
                        self.hidden = _detach(hidden)
                        self.step += 1
                        loss_sum += loss.detach()
                        n_summed += 1
                        if self.step % log_every == 0:
                            mean, stopped = self._record(loss_sum, n_summed, stop.requested)
                            self.losses.append((self.step, mean))
                            loss_sum.zero_()
                            n_summed = 0
                            self._show(
                                epoch=str(loader.epoch),
                                loss=f"{mean:.3f}",
                                ppl=f"{math.exp(min(mean, 50.0)):.2f}",
                            )
                        elif not self.dist.enabled:
                            stopped = stop.requested
                        if self.bar is not None:
                            self.bar.update(1)
                        if checkpoint_every and self.step % checkpoint_every == 0:
                            self.pending = [float(loss_sum), float(n_summed)]
                            self.save()
                            last_saved = self.step
                        if done() or stopped:
                            break
                self.pending = [float(loss_sum), float(n_summed)]
                if self.step != last_saved or not (self.output_dir / STATE_FILE).exists():
                    self.save()
            finally:
                if self.bar is not None:
                    self.bar.close()
                    self.bar = None
        self.model.eval()
        losses = list(self.losses)
        if n_summed:
            # The mean since the last record; not saved as a record, so that a resumed
            # run records exactly what an uninterrupted one does.
            losses.append((self.step, self._record(loss_sum, n_summed)[0]))
        return CharLMTrainResult(
            model=self.model,
            step=self.step,
            epoch=loader.epoch,
            losses=losses,
            output_dir=self.output_dir,
            seconds=time.perf_counter() - start,
            dev_losses=list(self.dev_losses),
            stopped_by=int(stop.signum or signal.SIGTERM) if stopped else None,
        )

    def _record(self, loss_sum: torch.Tensor, n: int, stop: bool = False) -> Tuple[float, bool]:
        """The mean loss over the workers, and whether some worker was asked to stop."""
        count = torch.tensor(float(n), device=loss_sum.device)
        flag = torch.tensor(float(stop), device=loss_sum.device)
        total = torch.stack([loss_sum.detach().clone(), count, flag])
        if self.dist.enabled:
            torch.distributed.all_reduce(total)
        return float(total[0] / total[1]), bool(total[2] > 0)

    def _show(self, **values: str) -> None:
        self.postfix.update(values)
        if self.bar is not None:
            self.bar.set_postfix(self.postfix)

    def evaluate(self) -> float:
        """Mean loss per character on the dev text (all workers; each reads its share
        of the streams, with fixed sequence lengths and no dropout)."""
        assert self.dev is not None
        bptt = self.config["bptt"]
        world = self.dist.world_size
        batch_size = max(1, min(self.loader.batch_size, (len(self.dev) - 1) // (world * bptt)))
        loader = CharLMLoader(
            self.dev,
            batch_size,
            bptt,
            randomize=False,
            reverse=self.loader.reverse,
            rank=self.dist.rank,
            world_size=world,
        )
        vocab_size = len(self.model.dictionary)
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                hidden = self.model.init_hidden(batch_size)
                for x_np, y_np in loader:
                    y = _to_device(y_np, self.device)
                    logits, _, hidden = self.model(_to_device(x_np, self.device), hidden)
                    loss = F.cross_entropy(
                        logits.reshape(-1, vocab_size), y.reshape(-1), reduction="sum"
                    )
                    total[0] += loss.double()
                    total[1] += y.numel()
        finally:
            self.model.train(was_training)
        if self.dist.enabled:
            torch.distributed.all_reduce(total)
        return float(total[0] / total[1])

    def save(self) -> None:
        """Write `lm.pt` and `training_state.pt` (main worker; all must call it);
        with a dev text, evaluate it and keep the best model in `best-lm.pt`."""
        hidden = _gather_hidden(self.hidden, self.dist) if self.hidden is not None else None
        best = False
        if self.dev is not None:
            dev_loss = self.evaluate()
            best = all(dev_loss < previous for _, previous in self.dev_losses)
            self.dev_losses.append((self.step, dev_loss))
            self._show(dev_ppl=f"{math.exp(min(dev_loss, 50.0)):.2f}")
        if self.dist.is_main:
            state = {
                "version": TRAIN_STATE_VERSION,
                "step": self.step,
                "loader": self.loader.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "hidden": hidden,
                "losses": [list(item) for item in self.losses],
                "pending_loss": list(self.pending),
                "dev_losses": [list(item) for item in self.dev_losses],
                "config": self.config,
                "world_size": self.dist.world_size,
            }
            model_tmp = self.output_dir / (MODEL_FILE + ".tmp")
            state_tmp = self.output_dir / (STATE_FILE + ".tmp")
            self.model.save(model_tmp)
            # The two files are renamed one after the other: the state names the model it
            # belongs with, so a run stopped between the renames is not resumed from both.
            state["model_sha256"] = _sha256(model_tmp)
            torch.save(state, state_tmp)
            if best:
                best_tmp = self.output_dir / (BEST_MODEL_FILE + ".tmp")
                self.model.save(best_tmp)
                os.replace(best_tmp, self.output_dir / BEST_MODEL_FILE)
            os.replace(model_tmp, self.output_dir / MODEL_FILE)
            os.replace(state_tmp, self.output_dir / STATE_FILE)
        self.dist.barrier()


# The most memory a run (or a training state) may make the loader allocate beyond the
# text itself: bptt x streams ids per batch (Flair's defaults, 250 x 100, are 25,000).
_MAX_BATCH_IDS = 10_000_000


def _texts_sha256(texts: Sequence[PathLike]) -> str:
    """A SHA-256 of the training text files' bytes, in the order they are read (about
    0.2 s per 100 MB): a resume on another text of the same length is told apart, also
    one written over the old file with its old modification time (whose cached encoding
    would be reused); the loader state records the length only."""
    digest = hashlib.sha256()
    for path in expand_paths(texts):
        _hash_file(digest, path)
        digest.update(b"\x00")  # the boundary between files
    return digest.hexdigest()


def _shared_texts_sha256(texts: Sequence[PathLike], dist: _Dist) -> str:
    """`_texts_sha256` read by the main worker only and sent to the others."""
    digest = _texts_sha256(texts) if dist.is_main else None
    return _broadcast_json(digest, dist) if dist.enabled else digest


def _batch_ids_limit(n_chars: int) -> int:
    """The most ids a batch may hold: the text's length, or 10 million if more."""
    return max(n_chars, _MAX_BATCH_IDS)


def _whole(value: Any, low: int = 0) -> bool:
    return type(value) is int and value >= low


def _finite(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


# The settings a run takes and its training state keeps: (check, what it expects),
# used before a run starts and on --resume.
_SETTING_CHECKS: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "lr": (lambda v: _finite(v) and v > 0, "a finite number > 0"),
    "clip": (lambda v: _finite(v) and v >= 0, "a finite number >= 0 (0 turns clipping off)"),
    "seed": (lambda v: _whole(v) and v < 2**63, "a whole number >= 0 and < 2**63"),
    "bptt": (lambda v: _whole(v, 1), "a whole number >= 1"),
    "randomize": (lambda v: type(v) is bool, "true or false"),
}


def _check_resume_state(state: Dict[str, Any], path: Path, n_chars: int, model: CharLM) -> None:
    """Check every setting and count of a training state before anything is built
    from it: the file is data, and its `bptt` alone sizes the loader's buffers (a
    3 KB state with bptt 10**15 asked for petabytes)."""

    def refuse(field: str, value: Any, expected: str) -> None:
        shown = value if isinstance(value, (bool, int, float, str, type(None))) else type(value)
        raise ValueError(
            f"{path}: {field} = {str(shown)[:80]}, expected {expected}: the training state was "
            "edited or damaged (train-charlm never writes that). Restore it from a copy, or "
            "train again without --resume (into another output folder to keep this one)."
        )

    def section(key: str) -> Dict[str, Any]:
        value = state.get(key)
        if not isinstance(value, dict):
            refuse(key, value, "a dict")
        return value

    config, loader = section("config"), section("loader")
    if config.get("optimizer") not in OPTIMIZERS:
        refuse("config.optimizer", config.get("optimizer"), f"one of {OPTIMIZERS}")
    for key, (ok, expected) in _SETTING_CHECKS.items():
        if not ok(config.get(key)):
            refuse(f"config.{key}", config.get(key), expected)
    text_sha256 = config.get("text_sha256")  # absent in states written before it
    if text_sha256 is not None and not (
        isinstance(text_sha256, str) and len(text_sha256) == 64 and text_sha256.isalnum()
    ):
        refuse("config.text_sha256", text_sha256, "a SHA-256 in hex")
    for key in ("n_streams", "n_chars"):
        if not _whole(loader.get(key), 1):
            refuse(f"loader.{key}", loader.get(key), "a whole number >= 1")
    for key in ("epoch", "offset", "n_batches"):
        if not _whole(loader.get(key)):
            refuse(f"loader.{key}", loader.get(key), "a whole number >= 0")
    n_streams = loader["n_streams"]
    if loader["offset"] > n_chars // n_streams:
        refuse(
            "loader.offset", loader["offset"], f"at most a stream's length ({n_chars // n_streams})"
        )
    if type(loader.get("reverse")) is not bool:
        refuse("loader.reverse", loader.get("reverse"), "true or false")
    if not isinstance(loader.get("rng"), dict):
        refuse("loader.rng", loader.get("rng"), "a numpy bit generator state (a dict)")
    limit = _batch_ids_limit(n_chars)
    if config["bptt"] * n_streams > limit:
        refuse(
            "config.bptt",
            config["bptt"],
            f"a length whose batches ({n_streams} streams) hold at most {limit:,} ids (the text "
            f"has {n_chars:,} characters)",
        )
    if not _whole(state.get("step")):
        refuse("step", state.get("step"), "a whole number >= 0")
    for key in ("losses", "dev_losses"):
        rows = state.get(key, [])
        if not (
            isinstance(rows, list)
            and all(
                isinstance(row, (list, tuple))
                and len(row) == 2
                and _whole(row[0])
                and type(row[1]) in (int, float)
                for row in rows
            )
        ):
            refuse(key, rows, "a list of [step, loss] pairs")
    pending = state.get("pending_loss")
    if not (isinstance(pending, list) and all(type(v) in (int, float) for v in pending)):
        refuse("pending_loss", pending, "a list of losses")
    hidden = state.get("hidden")
    shape = (model.nlayers, n_streams, model.hidden_size)
    if hidden is not None and not (
        isinstance(hidden, (list, tuple))
        and len(hidden) == model.state_count
        and all(
            type(h) is torch.Tensor and h.is_floating_point() and h.shape == shape for h in hidden
        )
    ):
        refuse("hidden", hidden, f"null or {model.state_count} recurrent state(s) of shape {shape}")


def _hash_file(digest: Any, path: PathLike) -> None:
    """Add a file's bytes to `digest`, a block at a time."""
    with Path(path).open("rb") as file_:
        for block in iter(lambda: file_.read(1 << 20), b""):
            digest.update(block)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    _hash_file(digest, path)
    return digest.hexdigest()


def _shared_dictionary(
    texts: Sequence[PathLike], min_count: int, dist: _Dist, progress: bool
) -> CharDictionary:
    """Build the dictionary on the main worker and send it to the others."""
    items = [None]
    if dist.is_main:
        items[0] = build_dictionary(texts, min_count=min_count, progress=progress).idx2item
    if dist.enabled:
        items[0] = _broadcast_json(items[0], dist)
    return CharDictionary(items[0])


def _broadcast_json(obj: Any, dist: _Dist) -> Any:
    """Send a JSON-serialisable object from the main worker to the others, as UTF-8
    bytes in a tensor (unlike `broadcast_object_list`, nothing is unpickled)."""
    use_cuda = torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    data = json.dumps(obj).encode("utf8") if dist.is_main else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    torch.distributed.broadcast(size, src=0)
    buffer = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if dist.is_main:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    torch.distributed.broadcast(buffer, src=0)
    return json.loads(bytes(buffer.cpu().numpy()).decode("utf8"))


def _shared_encoding(
    texts: Sequence[PathLike],
    dictionary: CharDictionary,
    path: Path,
    dist: _Dist,
    progress: bool,
    what: str = "training text",
) -> EncodedText:
    """Encode the texts once (main worker), unless a matching encoding exists. `what`
    names the text in the messages."""
    if dist.is_main:
        reuse = False
        if (path / "ids.json").exists():
            try:
                found = EncodedText(path)
                reuse = found.matches(dictionary, texts)
                if reuse:
                    # Ids past the dictionary would index past the embedding table.
                    found.check_ids(len(dictionary))
            except (ValueError, OSError, KeyError):
                reuse = False
        if not reuse:
            encode_texts(texts, dictionary, path, progress=progress, what=what)
    dist.barrier()
    encoded = EncodedText(path)
    if not encoded.matches(dictionary):
        raise ValueError(
            f"The encoded text in {path} was made with another dictionary. Delete it to re-encode."
        )
    return encoded
